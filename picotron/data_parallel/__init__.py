"""Data parallelism (with ZeRO): every cp*dp rank sees different tokens, so gradients are
averaged over the cp_dp group, bucket by bucket, while backward is still running.

    grads = GradBuckets(model, pgm, config)         # flat buffers + hooks     (buckets.py)
    optimizer = DistributedAdamW(grads, pgm, config)  # sharded AdamW         (optimizer.py)
    ... backward with grads.sync = last micro-batch ...
    grads.finish(); optimizer.step(lr); grads.zero_grad()

With zero_stage=3, `ShardedParams(model, pgm, config, device)` (zero3.py) takes GradBuckets'
place: the parameters themselves are sharded, gathered layer by layer around each use.
"""
from picotron.data_parallel.buckets import GradBuckets  # noqa: F401
from picotron.data_parallel.optimizer import DistributedAdamW  # noqa: F401
from picotron.data_parallel.zero3 import ShardedParams  # noqa: F401
