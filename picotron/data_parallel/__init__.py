"""Data parallelism: every cp*dp rank sees different tokens, so gradients are averaged over the
cp_dp group before the optimizer step."""
from picotron.data_parallel.data_parallel import sync_gradients  # noqa: F401
