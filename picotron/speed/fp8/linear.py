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
The recipes (`training.fp8`):
- "tensorwise": one scale per tensor. Forward operands in e4m3; the output gradient dy in e5m2:
  gradients span more binades than activations and one scale must cover all of them, so range
  matters more than the last mantissa bit (Micikevicius et al. 2022, "FP8 formats for deep
  learning"). Each cast writes both layouts a GEMM needs in one pass: forward's x_q and its
  transpose for dW (kept for backward in FP8: half the bytes of bf16); dy_q and dy_q^T;
  W_q and W^T_q.
- "tensorwise_delayed": tensorwise with each activation's and gradient's scale taken from
  the previous optimizer step's amax at that operand (delayed.py), so that a cast needs
  no amax pass before it: it takes the tensor's amax for the next step while it casts.
- "rowwise": one scale per row of each operand, along K, so an outlier token or channel costs
  only its own row precision. Everything in e4m3, dy too: each row of dy has its own scale, so
  range is no longer the limit, and precision is (torchao's rowwise recipe makes the same
  choice). dW reduces over the tokens, so x^T and dy^T get scales of their own, per
  column of x and dy; forward casts x^T too and keeps it for backward (FP8, not bf16 x).
- "rowwise_bf16_dw": rowwise y and dx, and dW = dy^T x as a plain bf16 GEMM (torchao's
  "rowwise with high-precision weight gradient"). What it removes is what rowwise pays most
  for: the column-wise casts of x and dy (each an amax pass over the tokens, then a cast
  that writes a transposed copy), half of each linear's activation casts. What it costs:
  dW, a third of the FLOPs, at bf16 speed, so the GEMMs alone gain at most
  3 / (2 / r + 1) of bf16 for FP8 GEMMs r times faster (r = 1.8: 1.42x instead of 1.8x), and
  backward keeps x in bf16 (2 bytes a value) instead of x^T in FP8 (1). dW is then as exact
  as in a bf16 run. Worth it when the casts, not the GEMMs, are the limit.
Master weights, optimizer, and everything outside the projections stay as in bf16 runs.

Tensor parallelism: a sharded operand must get the scales one GPU would compute from the full
tensor, so that every layout gives the same numbers. A weight sharded by rows (column-parallel,
`out_group`) or by columns (row-parallel, `in_group`) all-reduces its amax with MAX over that
group; so does x of a row-parallel linear (its C_in is sharded) and dy of a column-parallel one
(its O is). Rowwise amaxes run along K, so only operands whose K is sharded need it.
Data, pipeline and context parallelism shard the tokens instead: each rank scales the tokens
it holds, as one GPU scales each micro-batch it runs. Under dp and pp those are one GPU's
micro-batches; under cp a rank holds a chunk of each sequence, and its tensor (and, for dW,
per-column) amaxes span that chunk only, so its activations round onto a grid at most as
coarse as one GPU's: other FP8 roundings of the same values, not an all-reduce on the
critical path of every cast. "tensorwise_delayed" pays that all-reduce on its first step
only (fp8_delayed.Site.whole_sequence); its later steps scale by amaxes rolled over cp x dp,
so under cp it computes one GPU's scales throughout.

Casting: an amax and a division op by op read and write the whole tensor several times, which
costs more than FP8's faster GEMM saves (bench/NOTES.md). On a GPU the casts are our Triton
kernels (cast.py via quantize.py): a rowwise operand in one kernel, a tensorwise one
in an amax pass and one cast pass writing both layouts; no compiler, so no recompilation. On
CPU (the tests) and inside training.compile's compiled layers they are fp8_quantize.reference,
the same math in torch. The weights are cast once per optimizer step, not per use, and shared
by every micro-batch's forward and backward (fp8_weights.Fp8WeightCache).

Fused casts (fused.py): under the row-scaled recipes, with our kernels and "selective"
(fp8_triton.fp8_swiglu_mlp), the SwiGLU kernels write their outputs' rowwise casts themselves:
forward h_q and its scales instead of h (the down projection's x), backward d(gu)_q and its
scales beside d(gu) (gate/up's dy, handed to this linear through `grad_cast`). The column-wise
casts (x^T, dy^T) cannot be fused this way: their scales need every token first. Under "tensorwise"
the same kernels take the amax of h and of d(gu) as they write them (handed to this linear through
`grad_cast` for d(gu)), so those casts skip their amax pass. Not done: the RMSNorm forward
(speed/kernels/triton_norms.py, whole rows too) writing the q/k/v and gate/up input's row cast; that
needs the norm's output to reach the projection as FP8 (the layer passes a bf16 tensor), for one
read of (N, C) a norm, ~0.03 ms at 1.7B's 32768 x 2048 bf16 at 4 TB/s.
"""
from typing import NamedTuple

import torch

from picotron.speed.fp8.delayed import for_this_call
from picotron.speed.fp8.quantize import E4M3, E5M2, amax_of, quantize
from picotron.speed.fp8.weights import one_matrix, weight_casts

RECIPES = ("tensorwise", "tensorwise_delayed", "rowwise", "rowwise_bf16_dw")
# The forward GEMM y = x W^T accumulates with the tensor cores' fast (less often promoted)
# sums; the gradients' GEMMs, whose sums run over more terms (dW over every token), do not.
# torchao's float8 training makes the same split. Measured in bench/NOTES.md.
FORWARD_FAST_ACCUM = True


class Recipe(NamedTuple):
    """What a recipe name means for the casts: per-row scales, dW in bf16, and activation
    scales from the previous step's amaxes (delayed.py). A tuple of constants, so that
    torch.compile takes it as one."""
    name: str
    rowwise: bool
    bf16_dw: bool
    delayed: bool = False


def recipe_of(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"FP8 recipe '{name}' is not one of {RECIPES}")
    return Recipe(name, name.startswith("rowwise"), name == "rowwise_bf16_dw",
                  name == "tensorwise_delayed")


def scaled_mm(a, a_scale, b, b_scale, out_dtype, out_shape=None, fast_accum=False):
    """(a * a_scale) @ (b * b_scale)^T for FP8 a (M, K), b (N, K), both row-major, scales () or per
    row, (M, 1) and (N, 1); fp32 accumulation, out (M, N) in out_dtype, or a fresh tensor of
    `out_shape` (..., N) written through its (M, N) view: not a view itself, so the packed SwiGLU
    may write its gradient over it (speed/kernels/triton_swiglu.py), as over fused_linear's output.
    `fast_accum`: Hopper's FP8 tensor cores keep partial sums in lower precision and promote them to
    fp32 less often (FORWARD_FAST_ACCUM)."""
    if b_scale.dim():                       # per row of b: a (1, N) row of scales for its columns
        b_scale = b_scale.reshape(1, -1)
    elif a.device.type == "cpu" and not a_scale.dim():
        # CPU only (the tests: FP8 runs are refused there). oneDNN's tensorwise e4m3 x e4m3
        # product takes 2-5 s a call on x86 CPUs with AVX512-FP16 (torch 2.13); the same
        # product with the scale repeated per row takes its fast path (milliseconds), and
        # equals it within fp32 rounding.
        a_scale = a_scale.expand(a.shape[0], 1).contiguous()
        b_scale = b_scale.expand(1, b.shape[0]).contiguous()
    out = None if out_shape is None else torch.empty(out_shape, dtype=out_dtype, device=a.device)
    y = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype,
                         out=None if out is None else out.view(-1, b.shape[0]),
                         use_fast_accum=fast_accum)
    return y if out is None else out


# The activations' casts, each along its GEMM's K (module docstring); the weights' are in
# weights.py. `in_group` / `out_group`: the TP group sharding C_in / O, or None.
# `site`: the operand's fp8_delayed.Site under "tensorwise_delayed", else None.

def tensor_amax(t, site, group, amax=None):
    """(amax to scale t by, where to record t's amax): under delayed scaling the site's
    amax from the last step (calibrating: t's own, all-reduced over `group`, or the given
    `amax`, which the kernel that wrote t took; either over the whole sequence under cp),
    else `amax` as given (None: quantize takes t's own)."""
    if site is None:
        return amax, None
    if site.calibrating:
        own = amax_of(t, "tensor", group) if amax is None else amax
        return site.whole_sequence(own), site.record_into(t.device)
    return site.scale_amax(t.device), site.record_into(t.device)


def cast_input(x2, recipe: Recipe, in_group, transposed: bool = True, site=None):
    """x (N, C_in) -> (x_q, x_s) for y = x W^T, and (x^T_q, its scale) for dW = dy^T x (None
    unless `transposed`). Rowwise: per token along C_in, and per feature along the tokens."""
    if not recipe.rowwise:
        amax, record = tensor_amax(x2, site, in_group)
        x_q, xt_q, x_s = quantize(x2, E4M3, "tensor", in_group, transposed=transposed,
                                  amax=amax, record=record)
        return (x_q, x_s), (xt_q, x_s) if transposed else None
    x_q, _, x_s = quantize(x2, E4M3, "row", in_group)
    if not transposed:
        return (x_q, x_s), None
    _, xt_q, xt_s = quantize(x2, E4M3, "column", rows=False, transposed=True)
    return (x_q, x_s), (xt_q, xt_s)


def cast_grad(dy2, recipe: Recipe, out_group, for_dx: bool = True, for_dw: bool = True,
              amax=None, site=None):
    """dy (N, O) -> (dy_q, dy_s) for dx, along O, and (dy^T_q, its scale) for dW, along the
    tokens (each None when not needed; dW's never under bf16_dw): e4m3 per row, or e5m2
    with one scale for both layouts (from `amax` when the kernel that wrote dy took it)."""
    for_dw = for_dw and not recipe.bf16_dw
    if not recipe.rowwise:
        amax, record = tensor_amax(dy2, site, out_group, amax)
        dy_q, dyt_q, s = quantize(dy2, E5M2, "tensor", out_group, rows=for_dx,
                                  transposed=for_dw, amax=amax, record=record)
        return (dy_q, s) if for_dx else None, (dyt_q, s) if for_dw else None
    dy = quantize(dy2, E4M3, "row", out_group)[::2] if for_dx else None
    dyt = quantize(dy2, E4M3, "column", rows=False, transposed=True)[1:] if for_dw else None
    return dy, dyt


def weight_grad(dy2, dyt, xt, x2, recipe: Recipe, dtype):
    """dW = dy^T x (O, C_in): in FP8 from the casts, or under bf16_dw from dy and x as they
    are (fp32 accumulation either way)."""
    if recipe.bf16_dw:
        return dy2.t().to(dtype) @ x2.to(dtype)
    return scaled_mm(*dyt, *xt, dtype)


class Fp8Linear(torch.autograd.Function):
    """y = x @ cat(weights)^T with the three GEMMs in FP8 (module docstring). Several weights
    (q/k/v, gate/up) run as one GEMM like speed/kernels/fused_linear.py; their gradients come back
    as row slices of one dW. Backward keeps x^T in FP8 (C_in, N) and its scale (x itself under
    bf16_dw), and the weights' FP8 copies (from `cache`, a Fp8WeightCache, if given). `grad_cast`: a
    fp8_fused.GradCastHandoff through which the kernel that writes dy may hand
    over dy's rowwise cast (then not cast again here) or its tensor amax, or None. `sites`:
    (x's, dy's) fp8_delayed.Site under "tensorwise_delayed", else None."""

    @staticmethod
    def forward(ctx, x, recipe, in_group, out_group, cache, grad_cast, sites, *weights):
        w = one_matrix(weights)                                    # (O, C_in)
        x2 = x.reshape(-1, x.shape[-1])                             # (N, C_in)
        need_dw = any(ctx.needs_input_grad[7:])
        x_site, ctx.dy_site = sites or (None, None)
        (x_q, x_s), xt = cast_input(x2, recipe, in_group,
                                    transposed=need_dw and not recipe.bf16_dw, site=x_site)
        casts = weight_casts(cache, weights, w, recipe.rowwise, in_group, out_group,
                             transposed=ctx.needs_input_grad[0])
        y = scaled_mm(x_q, x_s, casts.w_q, casts.w_s, x.dtype, (*x.shape[:-1], w.shape[0]),
                      fast_accum=FORWARD_FAST_ACCUM)
        ctx.recipe, ctx.casts, ctx.out_group = recipe, casts, out_group
        ctx.grad_cast = grad_cast
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w.dtype
        ctx.out_sizes = [wi.shape[0] for wi in weights]
        # the weights themselves only when W^T is cast in backward (no cache)
        ctx.save_for_backward(*(xt or (None, None)), x if need_dw and recipe.bf16_dw else None,
                              *(weights if cache is None else ()))
        return y

    @staticmethod
    def backward(ctx, dy):
        xt_q, xt_s, x, *weights = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[7:])
        dy2 = dy.reshape(-1, dy.shape[-1])
        whole = ctx.grad_cast is not None and ctx.grad_cast.whole
        given = ctx.grad_cast.take(dy) if ctx.grad_cast is not None else None
        # handed over: rowwise dy's cast (q, scale), tensorwise dy's amax (amax,), or
        # (whole) both tensorwise casts ((q, scale), (q^T, scale)) of a dy never written
        if whole:
            dy_c, dyt = given
        else:
            cast = given if ctx.recipe.rowwise else None
            amax = given[0] if given is not None and not ctx.recipe.rowwise else None
            dy_c, dyt = cast_grad(dy2, ctx.recipe, ctx.out_group, need_dx and cast is None,
                                  need_dw, amax, ctx.dy_site)
            dy_c = dy_c if cast is None else cast
        dx = dw = None
        if need_dx:
            wt_q, wt_s = ctx.casts.transposed(one_matrix(weights) if weights else None)
            dx = scaled_mm(*dy_c, wt_q, wt_s, ctx.x_dtype, ctx.x_shape)        # (..., C_in)
        if need_dw:
            x2 = None if x is None else x.reshape(-1, x.shape[-1])
            dw = weight_grad(dy2, dyt, (xt_q, xt_s), x2, ctx.recipe, ctx.w_dtype)  # (O, C_in)
        ctx.casts = ctx.grad_cast = None
        dws = dw.split(ctx.out_sizes, dim=0) if dw is not None else [None] * len(ctx.out_sizes)
        return (dx, None, None, None, None, None, None, *dws)


def fp8_linear(x, weights, recipe: str, in_group=None, out_group=None, cache=None,
               grad_cast=None, sites=None):
    """x @ cat(weights)^T in FP8 under `recipe` (RECIPES). x (..., C_in), weights [(O_i, C_in)]
    -> (..., sum O_i) in x's dtype. `in_group` / `out_group`: the tensor-parallel group over
    which C_in / O is sharded, if it is (tensor_parallel/layers.py). `cache`: the module's
    Fp8WeightCache (the weights cast once per optimizer step), or None to cast them at this
    use; not used while torch.compile traces (its graph casts them). `grad_cast`: see
    Fp8Linear (triton_layers.py's MLP passes one to gate/up). `sites`: (x's, dy's)
    fp8_delayed.Site, under "tensorwise_delayed" only."""
    if torch.compiler.is_compiling():
        cache = grad_cast = None
    return Fp8Linear.apply(x, recipe_of(recipe), in_group, out_group, cache, grad_cast,
                           for_this_call(sites), *weights)
