"""Context parallelism: every sequence is split over the cp ranks in the zigzag order
(sharding.py) and attention runs as ring attention (ring_attention.py), block by block
(kernels.py), or, with `distributed.cp_mode="ulysses"`, as all-to-alls that trade the
sequence split for a head split (ulysses.py)."""
from picotron.context_parallel.context_parallel import apply_context_parallel  # noqa: F401
from picotron.context_parallel.sharding import shard_sequence  # noqa: F401
