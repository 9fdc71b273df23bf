"""quantize: one GEMM operand to FP8 with its scales, by our Triton kernels or by the reference.

    x (N, K) -> (q (N, K) | None, q^T (K, N) | None, scale)      scale = amax / fp8_max
    "tensor": one scale ()          q and/or q^T                   (tensorwise recipe)
    "row":    per row (N, 1)        q only, scales along K         (rowwise: x, W, dy)
    "column": per column (K, 1)     q^T only: the rows of x^T      (rowwise: x^T, W^T, dy^T)
                                    along N, the GEMM's K for them

`reference` is the math in torch, op by op: the readable version, the test oracle, what CPU
runs, and what runs inside training.compile's compiled layers (the compiler fuses it with its
neighbours there; our kernels would be opaque to it). Everywhere else on a GPU the casts are
cast.py's kernels: rowwise one kernel, tensorwise an amax kernel and one cast that writes
both layouts.

Tensor parallelism: when another rank holds part of what an amax spans (`group`), the amax
is all-reduced (MAX) before the scale is taken, between the kernels.
"""
import torch
import torch.distributed as dist

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# format: (largest finite value, mantissa bits, exponent of the smallest normal)
FORMATS = {E4M3: (448.0, 3, -6), E5M2: (57344.0, 2, -14)}
FP8_MAX = {E4M3: FORMATS[E4M3][0], E5M2: FORMATS[E5M2][0]}      # 448, 57344
SCALINGS = {"tensor": 0, "row": 1, "column": 2}                 # the kernels' SCALING codes


def use_kernels(x) -> bool:
    """Our kernels on a GPU, outside a compiled region; the reference elsewhere."""
    return x.is_cuda and not torch.compiler.is_compiling()


def _kernels():
    """fp8_cast, imported at first use on a GPU: the plug-ins import this module on machines
    without Triton too."""
    import picotron.speed.fp8.cast as fp8_cast   # the module itself, not the package's init
    return fp8_cast


def _check(scaling, rows, transposed):
    assert scaling in SCALINGS, scaling
    assert rows or transposed, "nothing to write"
    assert scaling != "row" or not transposed, "per-row scales do not serve q^T: 'column'"
    assert scaling != "column" or not rows, "per-column scales do not serve q: 'row'"


def quantize(x, fp8_dtype, scaling: str, group=None, rows: bool = True,
             transposed: bool = False, amax=None, record=None, out=None):
    """(q, q^T, scale) of x (N, K) under `scaling` (module docstring); q or q^T is None when
    not asked for. `group`: the TP group over which the amax must be all-reduced, or None.
    `amax`: one computed before (`amax_of`), to cast x again with the same scale, or the
    delayed scale's (delayed.py). `record` (tensor scaling): int32 bits (a scalar, or a
    delayed site's slots) that also receive max |x| (this rank's, as fp32 bits, by atomic
    max), or None. `out`: (q, q^T, scale) to write into, as shaped here (None where not asked
    for): a weight's FP8 copies that a captured CUDA graph reads (weights.py), or None
    for new tensors."""
    _check(scaling, rows, transposed)
    assert record is None or scaling == "tensor", "amaxes are recorded per tensor"
    if not use_kernels(x):
        amax = amax_of(x, scaling, group) if amax is None else amax
        if record is not None:
            record_amax(record, reference_amax(x, "tensor"))
        made = reference(x, fp8_dtype, scaling, amax, rows, transposed)
        if out is None:
            return made
        for into, value in zip(out, made):
            if value is not None:
                into.copy_(value)
        return out
    if amax is None and scaling == "row" and _alone(group) and out is None:
        q, scale = _kernels().quantize_rows(x, fp8_dtype)       # amax and cast: one kernel
        return q, None, scale
    amax = amax_of(x, scaling, group) if amax is None else amax
    return _kernels().cast(x, amax, fp8_dtype, SCALINGS[scaling], rows, transposed, record,
                           out)


def record_amax(bits, amax):
    """bits (int32, any shape) = max(bits, amax's fp32 bits): the kernels' atomic max, in
    torch (for non-negative floats, and a NaN, the int32 order is the float order)."""
    torch.maximum(bits, amax.abs().float().view(torch.int32), out=bits)


def _alone(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


def amax_of(x, scaling: str, group=None):
    """fp32 amax of x (N, K): () of the tensor, (N, 1) per row, (K, 1) per column, all-reduced
    (MAX) over `group` unless this rank holds all it spans."""
    amax = (_kernels().amax(x, SCALINGS[scaling]) if use_kernels(x)
            else reference_amax(x, scaling))
    if not _alone(group):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def reference_amax(x, scaling: str):
    """fp32 amax: () of the tensor, (N, 1) per row, (K, 1) per column."""
    a = x.abs()
    if scaling == "tensor":
        return a.amax().float()
    if scaling == "row":
        return a.amax(dim=1, keepdim=True).float()
    return a.amax(dim=0).float().reshape(-1, 1)


def reference_scale(amax, fp8_dtype):
    """The fp32 dequantization scale mapping amax onto the format's max; an all-zero tensor
    gets a tiny scale instead of 0/0. A product by 1/fp8_max, not a division: our kernels
    compute the same product, so the two give the same bits."""
    return amax.clamp(min=1e-12) * (1.0 / FP8_MAX[fp8_dtype])


def reference(x, fp8_dtype, scaling: str, amax, rows: bool = True, transposed: bool = False):
    """quantize's cast in torch, given the amax: scale, then fp8(x * (1 / scale)) with a clamp
    that keeps a round-up past the max off NaN (e4m3fn has no infinity). A product by the
    scale's reciprocal, as our kernels compute it (one division per scale, not per value)."""
    scale = reference_scale(amax, fp8_dtype)
    fp8_max = FP8_MAX[fp8_dtype]
    inv = torch.ones_like(scale) / scale                # correctly rounded, as the kernels'
    q = (x.float() * (inv.reshape(1, -1) if scaling == "column" else inv))
    q = q.clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return (q.contiguous() if rows else None, q.t().contiguous() if transposed else None,
            scale)
