"""The SwiGLU kernels of the recomputing SwiGLU + down projection (triton_layers.py) writing FP8
directly, under "tensorwise_delayed": with the scale known before the tensor exists
(delayed.py), no bf16 copy of h or of d(gu) is ever written.

    forward    h = silu(gate) * up            (N, I)   ->  h_q               (down's x)
    backward   d gate, d up, h from gu and dh (N, 2I)  ->  d(gu)_q, d(gu)_q^T (gate/up's dy)
                                                           h^T_q              (down's dW)

Unfused, under delayed scaling, each of these is a bf16 tensor written by a SwiGLU kernel and
read back by a cast kernel: at SmolLM-360M (N = 32768 tokens, I = 2560) forward writes and
reads h (168 MB each way), backward writes d(gu) (336 MB) and h (168 MB) and reads both back:
~1.2 GB a layer that the kernels below never move; what they write is the FP8 itself.

Each program owns a (BLOCK_M tokens, BLOCK_K columns of I) tile. Backward writes three FP8
layouts of it: d(gu)'s rows (gate at column c, up at I + c), d(gu)^T's rows c and I + c, and
h^T's row c, the transposed ones through tl.trans of the FP8 tile (one byte a value), as
fp8_cast._cast writes q^T. d(gu)'s amax is recorded (the gate/up linear's dy site) as it is
computed; h's was recorded in forward (the same values: backward recomputes h by the same
ops).

Bit for bit the unfused path: the values cast are the ones the SwiGLU kernels would store
(rounded to gu's dtype), the scale and rounding are fp8_cast's (`_scales`, `_fp8_values`),
and d(gu) is in e5m2 and h in e4m3 as tensorwise casts them (tests/test_fp8_delayed.py).
"""
import torch
import triton
import triton.language as tl

from picotron.speed.fp8.cast import FORMATS, _fp8_values, _scales, record_slots
from picotron.speed.fp8.quantize import E4M3, E5M2
from picotron.speed.kernels.triton_swiglu import _amax_into_slot, _swiglu_grads, _swiglu_h

# (BLOCK_M, BLOCK_K, num_warps) on the GPU and on CPU (small: the tests walk the masks),
# measured on an H200 at I = 960 to 8192, 32768 tokens (bench/fp8_cast_tiles.py --kernels
# swiglu): forward 81-86% of the copy rate at I >= 2560; backward, three tiles through
# tl.trans, 67-69% (it was 44% with 128 x 64, 61% before its amaxes took one atomic).
TILES = {"forward": ((64, 128, 8), (16, 16, 1)), "backward": ((32, 64, 4), (16, 16, 1))}


@triton.jit
def _tile(ptr, rows64, cols, stride, mask):
    return tl.load(ptr + rows64[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _swiglu_fwd_fp8(gu_ptr, q_ptr, amax_ptr, s_ptr, seen_ptr, N, I, gu_stride,
                    RECORD: tl.constexpr, SLOTS: tl.constexpr, SLOT_STRIDE: tl.constexpr,
                    EXACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr,
                    MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """h's tile rounded to gu's dtype, times 1 / scale (from amax_ptr), to FP8 in q (N, I);
    its amax maxed into one of seen_ptr's SLOTS if RECORD; the scale stored by program
    (0, 0)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)
    g = _tile(gu_ptr, rows64, cols, gu_stride, mask)
    u = _tile(gu_ptr + I, rows64, cols, gu_stride, mask)
    h = _swiglu_h(g.to(tl.float32), u.to(tl.float32)).to(g.dtype).to(tl.float32)
    if RECORD:                                       # masked elements are 0: silu(0) * 0
        _amax_into_slot(seen_ptr, h, SLOTS, SLOT_STRIDE)
    scale, inv = _scales(tl.load(amax_ptr), FP8_MAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(s_ptr, scale)
    q = _fp8_values(h * inv, EXACT_ROUND, FP8_MAX, MANTISSA, MIN_EXP)
    tl.store(q_ptr + rows64[:, None] * I + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _store_both(q_ptr, qt_ptr, v, rows, rows64, cols, N, width, row_ok, col_ok):
    """An FP8 tile v (BLOCK_M, BLOCK_K) as rows of q (N, width) and as rows of q^T (width, N)."""
    tl.store(q_ptr + rows64[:, None] * width + cols[None, :], v,
             mask=row_ok[:, None] & col_ok[None, :])
    tl.store(qt_ptr + cols.to(tl.int64)[:, None] * N + rows[None, :], tl.trans(v),
             mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _swiglu_bwd_fp8(dh_ptr, gu_ptr, q_ptr, qt_ptr, ht_ptr, g_amax_ptr, h_amax_ptr, g_s_ptr,
                    h_s_ptr, seen_ptr, N, I, dh_stride, gu_stride, SLOTS: tl.constexpr,
                    SLOT_STRIDE: tl.constexpr, EXACT_ROUND: tl.constexpr,
                    G_MAX: tl.constexpr, G_MANTISSA: tl.constexpr, G_MIN_EXP: tl.constexpr,
                    H_MAX: tl.constexpr, H_MANTISSA: tl.constexpr, H_MIN_EXP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """d gate, d up and h of one tile (triton_swiglu._swiglu_grads, each rounded to gu's
    dtype): d(gu) cast by g_amax's scale into q (N, 2I) and q^T (2I, N), its amax maxed into
    one of seen_ptr's SLOTS; h cast by h_amax's scale into ht (I, N). Scales stored by
    program (0, 0)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < N, cols < I
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    g = _tile(gu_ptr, rows64, cols, gu_stride, mask)
    u = _tile(gu_ptr + I, rows64, cols, gu_stride, mask).to(tl.float32)
    dh = _tile(dh_ptr, rows64, cols, dh_stride, mask).to(tl.float32)
    dgate, dup, h = _swiglu_grads(g.to(tl.float32), u, dh)
    dgate = dgate.to(g.dtype).to(tl.float32)
    dup = dup.to(g.dtype).to(tl.float32)
    h = h.to(g.dtype).to(tl.float32)
    # one atomic for both halves (two cost 94 us of a 378 us kernel, one 39; masked elements
    # are 0, dh = 0 there); a NaN stays one
    _amax_into_slot(seen_ptr, tl.maximum(tl.abs(dgate), tl.abs(dup),
                                         propagate_nan=tl.PropagateNan.ALL), SLOTS, SLOT_STRIDE)
    g_scale, g_inv = _scales(tl.load(g_amax_ptr), G_MAX)
    h_scale, h_inv = _scales(tl.load(h_amax_ptr), H_MAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(g_s_ptr, g_scale)
        tl.store(h_s_ptr, h_scale)
    fp8 = q_ptr.dtype.element_ty
    qg = _fp8_values(dgate * g_inv, EXACT_ROUND, G_MAX, G_MANTISSA, G_MIN_EXP).to(fp8)
    qu = _fp8_values(dup * g_inv, EXACT_ROUND, G_MAX, G_MANTISSA, G_MIN_EXP).to(fp8)
    _store_both(q_ptr, qt_ptr, qg, rows, rows64, cols, N, 2 * I, row_ok, col_ok)
    _store_both(q_ptr + I, qt_ptr + I.to(tl.int64) * N, qu, rows, rows64, cols, N, 2 * I,
                row_ok, col_ok)
    qh = _fp8_values(h * h_inv, EXACT_ROUND, H_MAX, H_MANTISSA, H_MIN_EXP)
    tl.store(ht_ptr + cols.to(tl.int64)[:, None] * N + rows[None, :],
             tl.trans(qh.to(ht_ptr.dtype.element_ty)), mask=col_ok[:, None] & row_ok[None, :])


def _grid(kernel, gu2, n, i):
    bm, bk, warps = TILES[kernel][0 if gu2.is_cuda else 1]
    return (triton.cdiv(n, bm), triton.cdiv(i, bk)), dict(BLOCK_M=bm, BLOCK_K=bk,
                                                           num_warps=warps)


def swiglu_fp8(gu2, amax, record):
    """gu2 (N, 2I), unit column stride -> (h_q (N, I) e4m3, h_s ()): h = swiglu(gu2) cast
    with the scale of `amax` (a () fp32), max |h| maxed into `record` (int32 bits, a scalar or
    a site's slots: fp8_cast.record_slots) unless None."""
    n, i = gu2.shape[0], gu2.shape[1] // 2
    q = torch.empty((n, i), dtype=E4M3, device=gu2.device)
    scale = torch.empty((), dtype=torch.float32, device=gu2.device)
    if n > 0:
        grid, tile = _grid("forward", gu2, n, i)
        slots, slot_stride = record_slots(record)
        _swiglu_fwd_fp8[grid](gu2, q, amax, scale, amax if record is None else record, n, i,
                              gu2.stride(0), RECORD=record is not None, SLOTS=slots,
                              SLOT_STRIDE=slot_stride,
                              EXACT_ROUND=not gu2.is_cuda, FP8_MAX=FORMATS[E4M3][0],
                              MANTISSA=FORMATS[E4M3][1], MIN_EXP=FORMATS[E4M3][2], **tile)
    return q, scale


def swiglu_backward_fp8(dh2, gu2, dgu_amax, record, h_amax):
    """dh2 (N, I), gu2 (N, 2I) -> ((d(gu)_q (N, 2I), s), (d(gu)_q^T (2I, N), s), (h^T_q (I, N),
    h_s)): d(gu) in e5m2 with the scale of `dgu_amax`, its amax maxed into `record` (int32);
    h in e4m3 with the scale of `h_amax` (forward's)."""
    n, i = gu2.shape[0], gu2.shape[1] // 2
    q = torch.empty((n, 2 * i), dtype=E5M2, device=gu2.device)
    qt = torch.empty((2 * i, n), dtype=E5M2, device=gu2.device)
    ht = torch.empty((i, n), dtype=E4M3, device=gu2.device)
    g_s, h_s = (torch.empty((), dtype=torch.float32, device=gu2.device) for _ in range(2))
    if n > 0:
        grid, tile = _grid("backward", gu2, n, i)
        slots, slot_stride = record_slots(record)
        _swiglu_bwd_fp8[grid](dh2, gu2, q, qt, ht, dgu_amax, h_amax, g_s, h_s, record, n, i,
                              dh2.stride(0), gu2.stride(0), SLOTS=slots,
                              SLOT_STRIDE=slot_stride, EXACT_ROUND=not gu2.is_cuda,
                              G_MAX=FORMATS[E5M2][0], G_MANTISSA=FORMATS[E5M2][1],
                              G_MIN_EXP=FORMATS[E5M2][2], H_MAX=FORMATS[E4M3][0],
                              H_MANTISSA=FORMATS[E4M3][1], H_MIN_EXP=FORMATS[E4M3][2], **tile)
    return (q, g_s), (qt, g_s), (ht, h_s)
