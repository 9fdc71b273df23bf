"""Tensor parallelism (Megatron-LM): column/row-parallel linears, vocab-parallel embedding,
head, the f/g operators, and optional sequence parallelism (its collectives optionally
overlapped with the GEMMs, overlap.py).

Entered like every axis: `apply_tensor_parallel(model, pgm, config)` on the meta model."""
from picotron.tensor_parallel.tensor_parallel import TP_PLAN, apply_tensor_parallel  # noqa: F401
