"""`training.fp8`: a linear layer's three GEMMs in FP8, y = x @ W^T with bf16 in and out.

    y  = x  @ W^T     forward       x (N, C_in), W (O, C_in) -> y (N, O)    reduce over C_in
    dx = dy @ W       input grad    dy (N, O), W^T (C_in, O) -> dx (N, C_in) reduce over O
    dW = dy^T @ x     weight grad   dy^T (O, N), x^T (C_in, N) -> dW (O, C_in) reduce over N

N is the number of tokens (all leading dims folded). Every GEMM here is written the same way,
"rows of A against rows of B along K": both operands are row-major (rows, K) FP8 matrices, each
with a dequantization scale, and torch._scaled_mm computes (a_q * a_s) @ (b_q * b_s)^T with fp32
accumulation (b_q^T is the column-major layout the FP8 tensor cores want).

FP8 holds 8 bits: e4m3 (max 448, 3 mantissa bits: relative rounding <= 2^-4) and e5m2 (max
57344, 2 mantissa bits: <= 2^-3). A tensor is divided by a scale that maps its largest
magnitude (amax) onto the format's max, rounded to FP8, and the scale is kept to undo it:
    scale = amax / fp8_max,  q = fp8(x / scale),  x ~ q * scale.
Two recipes (`training.fp8`):
- "tensorwise": one scale per tensor. Forward operands in e4m3; the output gradient dy in e5m2:
  gradients span more binades than activations and one scale must cover all of them, so range
  matters more than the last mantissa bit (Micikevicius et al. 2022, "FP8 formats for deep
  learning"). Each cast writes both layouts a GEMM needs in one pass: forward's x_q and its
  transpose for dW (kept for backward in FP8: half the bytes of bf16); dy_q and dy_q^T;
  W^T is cast again in backward with forward's scale.
- "rowwise": one scale per row of each operand, along K, so an outlier token or channel costs
  only its own row precision. Everything in e4m3, dy too: each row of dy has its own scale, so
  range is no longer the limit, and precision is (torchao's rowwise recipe makes the same
  choice). dW reduces over the tokens, so x^T and dy^T get scales of their own, per
  column of x and dy; forward casts x^T too and keeps it for backward (FP8, not bf16 x).
Master weights, optimizer, and everything outside the projections stay as in bf16 runs.

Tensor parallelism: a sharded operand must get the scales one GPU would compute from the full
tensor, so that every layout gives the same numbers. A weight sharded by rows (column-parallel,
`out_group`) or by columns (row-parallel, `in_group`) all-reduces its amax with MAX over that
group; so does x of a row-parallel linear (its C_in is sharded) and dy of a column-parallel one
(its O is). Rowwise amaxes run along K, so only operands whose K is sharded need it.

Casting: an eager amax and division read and write the whole tensor op by op, which costs more
than FP8's faster GEMM saves (one layer's GEMMs on an H200: 0.24-0.82x of bf16 with eager
casts, 1.36-1.79x with fused ones). On a GPU the casts are therefore torch.compile'd
(`_compiled`: the amax, the division and the rounding of a tensor in one or two kernels); on
CPU (the tests) they run as written. bench/bench_fp8.py times both.
"""
import torch
import torch.distributed as dist

from picotron.speed.fused_linear import stacked

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}      # 448, 57344
RECIPES = ("tensorwise", "rowwise")


def _amax(x, rowwise: bool):
    """fp32 largest magnitude: () for the whole tensor, (rows, 1) per row of x (rows, K)."""
    a = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    return a.float()


def _scale(amax, fp8_dtype):
    """The fp32 dequantization scale that maps amax onto the format's max; an all-zero tensor
    gets a tiny scale instead of 0/0."""
    return amax.clamp(min=1e-12) / FP8_MAX[fp8_dtype]


def _cast(x, scale, fp8_dtype, both: bool = False):
    """fp8(x / scale) as a contiguous (rows, K) copy, and with `both` its contiguous transpose
    too (one read of x for the two layouts). The clamp keeps a round-up past the max off NaN
    (e4m3fn has no infinity)."""
    fp8_max = FP8_MAX[fp8_dtype]
    q = (x.float() / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return (q.contiguous(), q.t().contiguous()) if both else q.contiguous()


def _quantize_local(x, rowwise: bool, fp8_dtype, both: bool = False):
    """(q, scale) or, with `both`, ((q, q^T), scale) of x from its own amax: one function, for
    the compiler to fuse."""
    scale = _scale(_amax(x, rowwise), fp8_dtype)
    return _cast(x, scale, fp8_dtype, both), scale


def _compiled(fn):
    """fn, torch.compile'd for CUDA tensors, as written elsewhere. Compiled on first use for
    any shape (dynamic): every projection's operands, in both layouts, share a few graphs, one
    per recipe's format and layout, well under the compiler's limit of recompilations. The
    compiler is only imported then (seconds), not by every run that imports the plug-ins."""
    compiled = []

    def run(x, *args):
        if not x.is_cuda or torch.compiler.is_compiling():    # inside training.compile's layer:
            return fn(x, *args)                               # its compiler fuses fn already
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](x, *args)
    return run


_amax_fast, _cast_fast, _quantize_fast = map(_compiled, (_amax, _cast, _quantize_local))


def quantize(x, fp8_dtype, rowwise: bool, group=None, both: bool = False):
    """(q, scale) of x (rows, K): q fp8 (rows, K) contiguous (with `both`, the pair (q, q^T);
    tensorwise only, where one scale serves both), scale fp32, per row along K, (rows, 1), if
    `rowwise`, else one (). The amax is all-reduced (MAX) over `group` when another rank holds
    the rest of what it spans."""
    assert not (both and rowwise), "a transposed copy shares the scale only tensorwise"
    if group is None or dist.get_world_size(group) == 1:
        return _quantize_fast(x, rowwise, fp8_dtype, both)
    amax = _amax_fast(x, rowwise)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = _scale(amax, fp8_dtype)
    return _cast_fast(x, scale, fp8_dtype, both), scale


def scaled_mm(a, a_scale, b, b_scale, out_dtype, out_shape=None):
    """(a * a_scale) @ (b * b_scale)^T for FP8 a (M, K), b (N, K), both row-major, scales () or
    per row, (M, 1) and (N, 1); fp32 accumulation, out (M, N) in out_dtype, or a fresh tensor
    of `out_shape` (..., N) written through its (M, N) view: not a view itself, so the packed
    SwiGLU may write its gradient over it (triton_swiglu.py), as over fused_linear's output."""
    if b_scale.dim():                       # per row of b: a (1, N) row of scales for its columns
        b_scale = b_scale.reshape(1, -1)
    out = None if out_shape is None else torch.empty(out_shape, dtype=out_dtype, device=a.device)
    y = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype,
                         out=None if out is None else out.view(-1, b.shape[0]))
    return y if out is None else out


def _one_matrix(weights):
    """The weights as one (O, C_in) matrix: a single one as it is (no buffer-sharing test for
    the compiler to trace), several stacked as fused_linear does."""
    return weights[0] if len(weights) == 1 else stacked(weights)


# The operands of the three GEMMs, each cast along its own K (module docstring). `in_group` /
# `out_group`: the TP group sharding C_in / O, or None.

def cast_input(x2, rowwise: bool, in_group, transposed: bool = True):
    """x (N, C_in) -> (x_q, x_s) for y = x W^T, and (x^T_q, its scale) for dW = dy^T x (None
    unless `transposed`). Rowwise: per token along C_in, and per feature along the tokens."""
    if rowwise:
        xt = quantize(x2.t(), E4M3, True) if transposed else None
        return quantize(x2, E4M3, True, in_group), xt
    if not transposed:
        return quantize(x2, E4M3, False, in_group), None
    (x_q, xt_q), x_s = quantize(x2, E4M3, False, in_group, both=True)     # one scale: both
    return (x_q, x_s), (xt_q, x_s)


def cast_weight(w, rowwise: bool, in_group, out_group):
    """W (O, C_in) for y: rows along C_in, so rowwise needs only in_group; one scale needs
    every shard, whichever way W is split."""
    return quantize(w, E4M3, rowwise, in_group if rowwise else in_group or out_group)


def cast_weight_t(w, w_s, rowwise: bool, out_group):
    """W^T (C_in, O) for dx = dy W: rowwise, along O; tensorwise, with forward's scale w_s."""
    if rowwise:
        return quantize(w.t(), E4M3, True, out_group)
    return _cast_fast(w.t(), w_s, E4M3), w_s


def cast_grad(dy2, rowwise: bool, out_group):
    """dy (N, O) -> (dy_q, dy_s) for dx, along O, and (dy^T_q, its scale) for dW, along the
    tokens: e4m3 per row, or e5m2 with one scale for both layouts."""
    if rowwise:
        return quantize(dy2, E4M3, True, out_group), quantize(dy2.t(), E4M3, True)
    (dy_q, dyt_q), dy_s = quantize(dy2, E5M2, False, out_group, both=True)
    return (dy_q, dy_s), (dyt_q, dy_s)


class Fp8Linear(torch.autograd.Function):
    """y = x @ cat(weights)^T with the three GEMMs in FP8 (module docstring). Several weights
    (q/k/v, gate/up) run as one GEMM like fused_linear.py; their gradients come back as row
    slices of one dW. Backward keeps x^T in FP8 (C_in, N) and its scale, and the weights."""

    @staticmethod
    def forward(ctx, x, rowwise, in_group, out_group, *weights):
        w = _one_matrix(weights)                                    # (O, C_in)
        (x_q, x_s), (xt_q, xt_s) = cast_input(x.reshape(-1, x.shape[-1]), rowwise, in_group)
        w_q, w_s = cast_weight(w, rowwise, in_group, out_group)
        y = scaled_mm(x_q, x_s, w_q, w_s, x.dtype, (*x.shape[:-1], w.shape[0]))   # (..., O)
        ctx.rowwise, ctx.out_group = rowwise, out_group
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.out_sizes = [wi.shape[0] for wi in weights]
        ctx.save_for_backward(xt_q, xt_s, w_s, *weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        xt_q, xt_s, w_s, *weights = ctx.saved_tensors
        w = _one_matrix(weights)                                    # (O, C_in)
        (dy_q, dy_s), (dyt_q, dyt_s) = cast_grad(dy.reshape(-1, dy.shape[-1]), ctx.rowwise,
                                                 ctx.out_group)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt_q, wt_s = cast_weight_t(w, w_s, ctx.rowwise, ctx.out_group)
            dx = scaled_mm(dy_q, dy_s, wt_q, wt_s, ctx.x_dtype, ctx.x_shape)     # (..., C_in)
        if any(ctx.needs_input_grad[4:]):
            dw = scaled_mm(dyt_q, dyt_s, xt_q, xt_s, w.dtype)                      # (O, C_in)
        dws = dw.split(ctx.out_sizes, dim=0) if dw is not None else [None] * len(weights)
        return (dx, None, None, None, *dws)


def fp8_linear(x, weights, recipe: str, in_group=None, out_group=None):
    """x @ cat(weights)^T in FP8 under `recipe` ("tensorwise" | "rowwise"). x (..., C_in),
    weights [(O_i, C_in)] -> (..., sum O_i) in x's dtype. `in_group` / `out_group`: the
    tensor-parallel group over which C_in / O is sharded, if it is (tensor_parallel/layers.py)."""
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe '{recipe}' is not one of {RECIPES}")
    return Fp8Linear.apply(x, recipe == "rowwise", in_group, out_group, *weights)
