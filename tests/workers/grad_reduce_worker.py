"""Train several configs in one launch (as train_many.py), recording what each reduction moves.

    torchrun --nproc_per_node N tests/workers/grad_reduce_worker.py RESULT_JSON CONFIG ...

While each config trains, spies around the cp_dp reductions of GradBuckets (`_launch`) and of
ZeRO-3's ShardedParams (`_reduce` and its reduce-scatter) record, per run:
    buffer    dtypes of the gradient buffers being reduced
    wire      dtypes of the tensors handed to the collective (the dtype on the wire)
    in_place  whether that tensor was the buffer itself (no cast copy)
    shard     dtypes of the gradient shards the optimizer read
Rank 0 writes {exp_name: {key: sorted list of what was seen}} to RESULT_JSON.
"""
import datetime
import json
import os
import sys
from collections import defaultdict

import torch.distributed as dist

import train
from picotron.data_parallel import buckets, zero3

SEEN = defaultdict(set)


def install_spies():
    launch, reduce, scatter = (buckets.GradBuckets._launch, zero3.ShardedParams._reduce,
                               zero3.reduce_scatter_single)
    reducing = []                                 # ZeRO-3: the buffer of the reduce in progress

    def spy_launch(self, bucket):
        launch(self, bucket)
        if bucket.wire is not None:               # cp_dp > 1: something went on the wire
            SEEN["buffer"].add(str(bucket.grads.dtype))
            SEEN["wire"].add(str(bucket.wire.dtype))
            SEEN["in_place"].add(bucket.wire is bucket.grads)

    def spy_reduce(self, b):
        reducing[:] = [b.grads]
        reduce(self, b)

    def spy_scatter(out, inp, **kwargs):
        SEEN["buffer"].add(str(reducing[0].dtype))
        SEEN["wire"].add(str(inp.dtype))
        SEEN["in_place"].add(inp is reducing[0])
        return scatter(out, inp, **kwargs)

    def spy_shard(original):
        def grad_shard(self, bucket):
            shard = original(self, bucket)
            SEEN["shard"].add(str(shard.dtype))
            return shard
        return grad_shard

    buckets.GradBuckets._launch = spy_launch
    zero3.ShardedParams._reduce = spy_reduce
    zero3.reduce_scatter_single = spy_scatter
    buckets.GradBuckets.grad_shard = spy_shard(buckets.GradBuckets.grad_shard)
    zero3.ShardedParams.grad_shard = spy_shard(zero3.ShardedParams.grad_shard)


def main(result_path: str, configs):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    install_spies()
    result = {}
    for path in configs:
        SEEN.clear()
        try:
            train.main(["--config", path])
        except Exception as e:
            raise RuntimeError(f"training {path} failed: {e}") from e
        result[os.path.basename(os.path.dirname(path))] = {k: sorted(v, key=str)
                                                           for k, v in SEEN.items()}
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
