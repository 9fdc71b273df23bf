"""FP8 casts fused into the SwiGLU kernels that produce the GEMM operands: the casts themselves
(rowwise scales), or the amax their scale needs (tensorwise).

Under the row-scaled recipes ("rowwise", "rowwise_bf16_dw") two operands of the MLP's GEMMs come
straight out of our SwiGLU kernels (speed/kernels/triton_swiglu.py), which see whole rows of them:

    forward   h = silu(gate) * up    (N, I)    the down projection's x: y = h W_down^T
    backward  d(gu) = (d gate, d up) (N, 2I)   gate/up's dy: dx = d(gu) W_gate/up

Unfused, each is written in bf16, then fp8_cast's row kernel reads it back twice (row amax,
then cast) and writes q and one fp32 scale per row. Fused, the SwiGLU kernel itself takes the
row amax and writes q (N, K) and the scales (N, 1):
- forward (`swiglu_rowwise`): h_q and its scales instead of bf16 h, which the recomputing
  SwiGLU + down projection (fp8_triton.Fp8SwiGLULinear) drops after forward anyway;
- backward (`swiglu_backward_rowwise`): d(gu)_q and its scales as well as bf16 d(gu): both
  recipes still need the bf16 gradient, "rowwise_bf16_dw" for dW = d(gu)^T x, "rowwise" for
  the column-scaled d(gu)^T, whose scales span every token and so stay a separate cast.

A row's scale needs the whole row's amax before its first value can be cast, and rows are
long (I = 8192 at 1.7B, 2I = 16384). The choice here: each program owns ROWS rows and walks
them twice, as fp8_cast._rowwise does. Pass 1 computes the SwiGLU (or its gradient), stores
what it stores today and keeps the running row amax of those values rounded to the output's
dtype; pass 2 casts. Forward's pass 2 recomputes h from gate and up (no bf16 h is written at
all); backward's re-reads the d(gu) it has just written (gate and up are overwritten in
place by then), after a barrier so that every thread of the program sees those stores. One
row a program keeps what a program touches between its two reads of a value small (32 KB
of gu at I = 8192), so that the second read should mostly come from L2. Keeping the row in
registers instead would bound I by the register file; this works at any I. TILE below is
a first guess, not measured (bench/bench_fp8.py gemms --fused_tile sweeps it).

Bit for bit: the values cast are the bf16 (gu's dtype) values the unfused kernels store, the
scale and the rounding are fp8_cast's (`_scales`, `_fp8_values`: amax * (1 / fp8_max), each
value times the scale's reciprocal, saturated, and rounded by the conversion, or by
`_fp8_round` in the interpreter): fp8_quantize.reference's rowwise cast of the same tensor,
scales included (tests/test_fp8_fused.py, on CPU and on the GPU).

Tensorwise ("tensorwise"): one scale for the whole tensor, so no value can be cast before every
value has been seen, and no kernel that writes a tensor can also cast it. What the SwiGLU kernels
can do is take the amax of what they store (speed/kernels/triton_swiglu.py's `amax`, one atomic max
per program): forward h's (`swiglu_cast`), backward d(gu)'s (`swiglu_backward_cast`), and fp8_cast's
cast kernel runs on with it, the amax pass over h and over d(gu) gone (1.5 GB of reads a layer at
1.7B: 0.5 GB of h, 1 GB of d(gu)). The same
bits as unfused: an amax is exact whichever order it is taken in.

Handing d(gu)'s cast to its GEMM. Autograd passes gate/up's linear only the bf16 gradient, so
the cast (rowwise: q and scales; tensorwise: the amax) travels beside it in a
`GradCastHandoff`, made per MLP forward when the fusion applies and held by both autograd
nodes: the SwiGLU backward puts (d(gu), its version, the cast), the linear's backward takes
it if the gradient it receives is that very tensor (same memory, shape and version), else
it casts as before.

Where it applies: the MLP of model.kernels="triton" under "selective" (the GPU defaults),
fp8_triton.fp8_swiglu_mlp; without "selective" h is kept in bf16 for the down projection and
the casts stay separate. When (`fusable`): our kernels (a GPU outside compiled regions:
fp8_quantize.use_kernels) and a tensor that one rank holds whole; under tensor parallelism I
(2I) is sharded and the amax needs an all-reduce first: the separate casts.
FUSED = False turns the fusion off everywhere (the separate cast kernels, as before).
"""
import torch
import triton
import triton.language as tl

import picotron.speed.fp8.quantize as fp8_quantize
from picotron.speed.fp8.cast import FORMATS, _fp8_values, _scales
from picotron.speed.kernels.triton_swiglu import (_swiglu_backward, _swiglu_forward, _swiglu_grads,
                                                  _swiglu_h)

FUSED = True
TILE = (1, 2048, 4)     # ROWS, BLOCK (columns of h a step), num_warps: 16 values per thread


def fusable(group, t) -> bool:
    """Whether the SwiGLU kernels cast (or take the amax of) this operand: our kernels on t's
    device, and no other rank holding part of it (`group`: the TP group sharding I, or None)."""
    return FUSED and fp8_quantize.use_kernels(t) and fp8_quantize._alone(group)


def swiglu_cast(gu2, recipe):
    """gu2 (N, 2I) -> (h_q (N, I), h_s, h's amax or None): h's FP8 cast for the down
    projection, rowwise by the SwiGLU kernel itself (no bf16 h), tensorwise by the cast kernel
    from the amax the SwiGLU kernel took (the amax is returned: h^T's cast in backward)."""
    if recipe.rowwise:
        return (*swiglu_rowwise(gu2), None)
    bits = torch.zeros((), dtype=torch.int32, device=gu2.device)
    h = _swiglu_forward(gu2, amax=bits)
    amax = bits.view(torch.float32)
    h_q, _, h_s = fp8_quantize.quantize(h, fp8_quantize.E4M3, "tensor", amax=amax)
    return h_q, h_s, amax


def swiglu_backward_cast(dh2, gu2, dgu2, recipe, store_h: bool):
    """triton_swiglu._swiglu_backward (d(gu) into dgu2, h into dh2 if store_h), and what
    gate/up's linear needs to cast d(gu): rowwise the cast itself (q, scale), tensorwise
    its amax (amax,)."""
    if recipe.rowwise:
        return swiglu_backward_rowwise(dh2, gu2, dgu2, store_h)
    bits = torch.zeros((), dtype=torch.int32, device=gu2.device)
    _swiglu_backward(dh2, gu2, dgu2, store_h, amax=bits)
    return (bits.view(torch.float32),)


@triton.jit
def _h_tile(gu_rows, cols, n_cols, mask):
    """h of one tile as fp32 holding the values of gu's dtype (what _swiglu_fwd stores)."""
    g = tl.load(gu_rows + cols[None, :], mask=mask, other=0.0)
    u = tl.load(gu_rows + n_cols + cols[None, :], mask=mask, other=0.0)
    return _swiglu_h(g.to(tl.float32), u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _swiglu_fwd_rowwise(gu_ptr, q_ptr, s_ptr, n_rows, n_cols, gu_stride,
                        EXACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr,
                        MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows of h = silu(gate) * up (gate: columns [0, I) of gu, up: [I, 2I)): pass 1
    the row amax, pass 2 h again, times 1 / the row's scale, rounded and stored as FP8."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    gu_rows = gu_ptr + rows.to(tl.int64)[:, None] * gu_stride      # N * 2I may pass 2^31
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    start = 0        # `while`: Triton's interpreter cannot take a range with run-time bounds
    while start < n_cols:
        cols = start + tl.arange(0, BLOCK)
        h = _h_tile(gu_rows, cols, n_cols, row_ok[:, None] & (cols < n_cols)[None, :])
        amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1), propagate_nan=tl.PropagateNan.ALL)
        start += BLOCK
    scale, inv = _scales(amax, FP8_MAX)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * n_cols
    start = 0
    while start < n_cols:
        cols = start + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        h = _h_tile(gu_rows, cols, n_cols, mask)
        q = _fp8_values(h * inv[:, None], EXACT_ROUND, FP8_MAX, MANTISSA, MIN_EXP)
        tl.store(q_rows + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        start += BLOCK


@triton.jit
def _swiglu_bwd_rowwise(dh_ptr, gu_ptr, dgu_ptr, q_ptr, s_ptr, n_rows, n_cols, dh_stride,
                        gu_stride, dgu_stride, STORE_H: tl.constexpr,
                        EXACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr,
                        MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows: pass 1 is triton_swiglu._swiglu_bwd along the row (d gate and d up stored,
    over gu when dgu_ptr is gu_ptr, and h over dh if STORE_H) keeping the amax of the stored
    d(gu); pass 2 re-reads the stored row of d(gu) (2I values) and writes its FP8 cast."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    start = 0
    while start < n_cols:
        cols = start + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        gate_ptrs = gu_ptr + rows64 * gu_stride + cols[None, :]
        g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
        dh_ptrs = dh_ptr + rows64 * dh_stride + cols[None, :]
        dh = tl.load(dh_ptrs, mask=mask, other=0.0).to(tl.float32)
        dgate, dup, h = _swiglu_grads(g, u, dh)
        dgate, dup = dgate.to(dgu_ptr.dtype.element_ty), dup.to(dgu_ptr.dtype.element_ty)
        out_ptrs = dgu_ptr + rows64 * dgu_stride + cols[None, :]
        tl.store(out_ptrs, dgate, mask=mask)
        tl.store(out_ptrs + n_cols, dup, mask=mask)
        if STORE_H:
            tl.store(dh_ptrs, h.to(dh_ptr.dtype.element_ty), mask=mask)
        amax = tl.maximum(amax, tl.max(tl.abs(dgate.to(tl.float32)), axis=1),
                          propagate_nan=tl.PropagateNan.ALL)
        amax = tl.maximum(amax, tl.max(tl.abs(dup.to(tl.float32)), axis=1),
                          propagate_nan=tl.PropagateNan.ALL)
        start += BLOCK
    scale, inv = _scales(amax, FP8_MAX)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    tl.debug_barrier()      # pass 1's stores seen by every thread of this program
    start = 0
    while start < 2 * n_cols:                       # the whole row of d(gu): gate, then up
        cols = start + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < 2 * n_cols)[None, :]
        v = tl.load(dgu_ptr + rows64 * dgu_stride + cols[None, :], mask=mask, other=0.0)
        q = _fp8_values(v.to(tl.float32) * inv[:, None], EXACT_ROUND, FP8_MAX, MANTISSA,
                        MIN_EXP)
        tl.store(q_ptr + rows64 * (2 * n_cols) + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=mask)
        start += BLOCK


def _grid_and_tile(n_rows, n_cols):
    rows, block, warps = TILE
    block = min(block, triton.next_power_of_2(n_cols))
    return (triton.cdiv(n_rows, rows),), dict(ROWS=rows, BLOCK=block, num_warps=warps)


def swiglu_rowwise(gu2, fp8_dtype=fp8_quantize.E4M3):
    """gu2 (N, 2I), unit column stride -> (h_q (N, I), h_s (N, 1) fp32): the rowwise cast of
    swiglu(gu2) in gu2's dtype, without writing h itself."""
    n, i2 = gu2.shape
    q = torch.empty((n, i2 // 2), dtype=fp8_dtype, device=gu2.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=gu2.device)
    if n > 0:
        grid, tile = _grid_and_tile(n, i2 // 2)
        _swiglu_fwd_rowwise[grid](gu2, q, scale, n, i2 // 2, gu2.stride(0),
                                  not gu2.is_cuda, *FORMATS[fp8_dtype], **tile)
    return q, scale


def swiglu_backward_rowwise(dh2, gu2, dgu2, store_h: bool, fp8_dtype=fp8_quantize.E4M3):
    """triton_swiglu._swiglu_backward (d(gu) into dgu2 (N, 2I), and h into dh2 (N, I) if
    store_h), returning d(gu)'s rowwise cast as well: (q (N, 2I), scale (N, 1) fp32)."""
    n, i2 = gu2.shape
    q = torch.empty((n, i2), dtype=fp8_dtype, device=gu2.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=gu2.device)
    if n > 0:
        grid, tile = _grid_and_tile(n, i2 // 2)
        _swiglu_bwd_rowwise[grid](dh2, gu2, dgu2, q, scale, n, i2 // 2, dh2.stride(0),
                                  gu2.stride(0), dgu2.stride(0), STORE_H=store_h,
                                  EXACT_ROUND=not gu2.is_cuda, FP8_MAX=FORMATS[fp8_dtype][0],
                                  MANTISSA=FORMATS[fp8_dtype][1],
                                  MIN_EXP=FORMATS[fp8_dtype][2], **tile)
    return q, scale


class GradCastHandoff:
    """A gradient's FP8 cast (rowwise: (q, scale)) or amax (tensorwise: (amax,)), from the
    kernel that wrote the gradient to the linear whose GEMMs read it (module docstring), or,
    `whole`, both of its tensorwise casts ((q, scale), (q^T, scale)) standing in for a
    gradient that was never written (delayed_swiglu.py). One per MLP forward; `take`
    empties it."""

    def __init__(self):
        self.grad, self.version, self.cast, self.whole = None, None, None, False

    def put(self, grad, *cast, whole: bool = False):
        self.grad, self.version, self.cast, self.whole = grad, grad._version, cast, whole

    def take(self, dy):
        """The cast tuple if dy is the gradient put here, unchanged since; else None, or,
        for a whole cast, an error: dy holds no values to cast instead."""
        grad, version, cast, whole = self.grad, self.version, self.cast, self.whole
        self.grad, self.version, self.cast, self.whole = None, None, None, False
        if cast is None or dy.data_ptr() != grad.data_ptr() or dy.shape != grad.shape \
                or dy.stride() != grad.stride() or dy._version != version:
            if whole:
                raise RuntimeError("the SwiGLU's FP8 gradient casts did not reach the gate/up "
                                   "projection: something between them changed the gradient")
            return None
        return cast
