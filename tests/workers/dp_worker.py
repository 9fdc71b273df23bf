"""Run on 4 gloo ranks: gradient-reduction overlap and ZeRO memory, measured for real.

For zero_stage 0, 1 and 2 it builds the model, runs one backward with bucketed reduction,
and records (rank 0 writes JSON to argv[1]):
- launch_log: (bucket index, gradients produced so far) at each reduction launch;
- reductions: the collectives the buckets were reduced with;
- the number of parameters (gradients produced in a full backward);
- optimizer state bytes and gradient bytes this rank holds at step time;
- how many of (model, buckets, optimizer, a weight, a bucket) are still alive once dropped."""
import gc
import json
import sys
import weakref

import torch
import torch.distributed as dist

import train
from picotron.config import Config, config_from_dict
from picotron.data.windows import build_data, micro_batch
from picotron.data_parallel import DistributedAdamW, GradBuckets
from picotron.loss import causal_lm_loss
from picotron.process_group_manager import ProcessGroupManager


def measure(zero_stage, offload, dtype="float32", master_weights=True, overlap=True):
    raw = Config().to_dict()
    raw["distributed"].update(dp_size=4, use_cpu=True, zero_stage=zero_stage,
                              overlap_grad_reduce=overlap,
                              bucket_size_mb=0.05, offload_optim_frac=offload)
    raw["model"].update(hidden_size=64, intermediate_size=160, num_hidden_layers=3)
    raw["training"].update(dtype=dtype, master_weights=master_weights, micro_batch_size=2,
                           seq_length=32)
    raw["dataset"]["name"] = "synthetic"
    config = config_from_dict(raw, world_size=4)
    pgm = ProcessGroupManager(dp=4)
    model = train.build_model(config, pgm, torch.device("cpu"))
    # A parameter that never receives a gradient must not leave its bucket waiting forever.
    model.unused = torch.nn.Parameter(torch.zeros(7, dtype=model.norm.weight.dtype))
    grads = GradBuckets(model, pgm, config)
    optimizer = DistributedAdamW(grads, pgm, config)
    inputs, targets = micro_batch(build_data(config), 0, 0, config, pgm)
    grads.sync = True
    kinds, launch = set(), GradBuckets._launch

    def spy(self, bucket):        # which collective each bucket's reduction was
        launch(self, bucket)
        kinds.add("reduce_scatter" if bucket.wire_shard is not None else "all_reduce")
    GradBuckets._launch = spy
    try:
        causal_lm_loss(model(inputs), targets).backward()
        grads.finish()
    finally:
        GradBuckets._launch = launch
    grad_bytes = sum(4 * (b.numel if b.grads is not None else 0)
                     + 4 * (b.grad_shard.numel() if b.grad_shard is not None else 0)
                     for b in grads.buckets)
    optimizer.step(1e-3)
    offloaded = sum(b.shard_numel for b, o in zip(grads.buckets, optimizer.offloaded) if o)
    result = {"bytes_per_param": optimizer.state_bytes() / sum(b.shard_numel for b in grads.buckets),
            "launch_log": grads.launch_log, "reductions": sorted(kinds), "num_params": len(list(model.parameters())),
            "num_buckets": len(grads.buckets), "state_bytes": optimizer.state_bytes(),
            "grad_bytes": grad_bytes, "offloaded_frac": offloaded / sum(
                b.shard_numel for b in grads.buckets)}
    # Dropped, the run must free its memory: model, gradient buffers, optimizer state.
    alive = [weakref.ref(o) for o in (model, grads, optimizer, model.norm.weight,
                                      grads.buckets[0])]
    del model, grads, optimizer, inputs, targets
    gc.collect()
    result["alive_after_drop"] = sum(ref() is not None for ref in alive)
    return result


def main(out_path):
    dist.init_process_group("gloo")
    results = {f"zero{z}": measure(z, 0.0) for z in (0, 1, 2)}
    results["zero1_offload_half"] = measure(1, 0.5)
    results["bf16_master"] = measure(0, 0.0, "bfloat16", True)
    results["bf16_no_master"] = measure(0, 0.0, "bfloat16", False)
    results["no_overlap"] = measure(0, 0.0, overlap=False)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
