"""FP8 casts as our own Triton kernels: amax, scale and rounding of an (N, K) bf16/fp32 operand.

    x (N, K), unit column stride -> q = fp8(x / scale) and/or its transpose q^T (K, N),
    with one fp32 scale for the whole tensor (), per row (N, 1) or per column (K, 1): the
    three scalings linear.py's GEMM operands need (quantize.py says which is which).

Three kernels, so that no cast is ever compiled (torch.compile recompiled on the strides of
transposed operands and then fell back to eager) and each reads x as few times as it can:
- `_rowwise`: per-row scales in one kernel. A program owns BLOCK_M rows and walks K twice:
  row amax, then scale and cast (the second walk reads the same rows again, mostly from L2).
  With AMAX_ONLY it stops after the amax, for an amax another rank must all-reduce first.
- `_amax`: the amax of the whole tensor or of each column. Program (j, p) takes column block
  j and row blocks p, p + P, ...: a running max in registers, then one atomic max per column
  (or one for the tensor) per program, so P programs, not N/BLOCK_M, contend per address.
  The atomics work on the fp32 bits as int32: for non-negative floats the two orders agree.
- `_cast`: given the amax, one pass writing q, q^T or both from one read of x (tensorwise,
  where one scale serves both layouts), and the scales the GEMM takes.

Scaling and rounding. Scales are amax * (1 / fp8_max) with amax clamped at 1e-12, and x is
multiplied by the scale's correctly rounded reciprocal (one division per scale, not per
value), exactly as fp8_quantize.reference computes them. On the GPU the conversion to FP8
rounds to nearest even and saturates by itself, so a kernel clamps and converts: a few
operations a value, which matters here, since these kernels move 4 bytes a value and a
division plus a rounding in fp32 (~25 operations) made them ALU-bound at 55% of the copy
rate (bench/NOTES.md). Triton's CPU interpreter converts wrongly (ties away from zero, and
the carry into the exponent dropped: 125.6 became 64), so there (EXACT_ROUND, set for CPU
tensors) `_fp8_round` first rounds the value onto the FP8 grid in fp32 (saturate, then add
and subtract 1.5 * 2^23 * step, which fp32 addition rounds to a multiple of the step, ties
to even), and the conversion that follows is exact: the tests compare these kernels with the
reference bit for bit on CPU, and on the GPU (tests/test_fp8_gpu.py) the hardware's own
rounding against the same reference.
"""
import torch
import triton
import triton.language as tl

from picotron.speed.kernels.triton_swiglu import _amax_into_slot

# The kernels' own copy of fp8_quantize's tables (which imports this module, on GPUs only;
# tests/test_fp8_kernels.py checks the two agree): SCALING codes, and per format its largest
# finite value, mantissa bits and the exponent of its smallest normal.
TENSOR, ROW, COLUMN = 0, 1, 2
FORMATS = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}


@triton.jit
def _fp8_round(v, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """v (fp32) saturated at +-FP8_MAX and rounded to the nearest FP8 value, ties to even, in
    fp32. The step between FP8 values near |v| is 2^(e - MANTISSA), e = floor(log2 |v|) (read
    from the fp32 exponent bits), never below the subnormals' 2^(MIN_EXP - MANTISSA)."""
    a = tl.minimum(tl.abs(v), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    magic = ((e - MANTISSA + 23 + 127) << 23).to(tl.float32, bitcast=True)    # step * 2^23
    r = (a + magic) - magic            # a + magic lies in [magic, 2 magic): its ulp is the step
    # v's sign bit onto r (>= 0) by bits: -0.0 stays -0.0 (on the GPU `-r` compiled to 0 - r,
    # which is +0.0)
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scales(amax, FP8_MAX: tl.constexpr):
    """(scale, 1 / scale) of an fp32 amax (any shape): the dequantization scale the GEMM takes,
    and the factor each value is multiplied by. A NaN amax gives a NaN scale, as torch's
    clamp in the reference does."""
    scale = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) * (1.0 / FP8_MAX)
    return scale, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _fp8_values(v, EXACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                MIN_EXP: tl.constexpr):
    """v (fp32, x times 1 / scale) ready for the conversion to FP8: saturated at +-FP8_MAX,
    and with EXACT_ROUND (the interpreter) already rounded onto the FP8 grid."""
    if EXACT_ROUND:
        return _fp8_round(v, FP8_MAX, MANTISSA, MIN_EXP)
    # PropagateNan.ALL: a NaN stays one (min/max would drop it); written at each call, as a
    # jitted function cannot hold the enum in a variable
    v = tl.maximum(v, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(v, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rowwise(x_ptr, q_ptr, s_ptr, N, K, stride, AMAX_ONLY: tl.constexpr,
             EXACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
             MIN_EXP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_M rows: amax over K, then (unless AMAX_ONLY, which stores the amax) the scale and
    q = fp8(x / scale), row by row along K."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]            # row * stride can pass 2^31 elements
    amax = tl.zeros((BLOCK_M,), dtype=tl.int32)   # as |x|'s bits, as in _amax: a NaN stays
    start = 0        # `while`: Triton's interpreter cannot take a range with run-time bounds
    while start < K:
        cols = start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows64 * stride + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True),
                                       axis=1))
        start += BLOCK_K
    amax = amax.to(tl.float32, bitcast=True)
    if AMAX_ONLY:
        tl.store(s_ptr + rows, amax, mask=row_ok)
    else:
        scale, inv = _scales(amax, FP8_MAX)
        tl.store(s_ptr + rows, scale, mask=row_ok)
        start = 0
        while start < K:
            cols = start + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows64 * stride + cols[None, :], mask=mask, other=0.0)
            q = _fp8_values(x.to(tl.float32) * inv[:, None], EXACT_ROUND, FP8_MAX, MANTISSA,
                            MIN_EXP)
            tl.store(q_ptr + rows64 * K + cols[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=mask)
            start += BLOCK_K


@triton.jit
def _amax(x_ptr, out_ptr, N, K, stride, PER_COLUMN: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Column block program_id(0), row blocks program_id(1) + i * num_programs(1): the
    largest |x| of each column (PER_COLUMN) or of the tensor, atomically maxed into out_ptr
    (int32 bits of non-negative fp32, zeroed by the caller). Reduced as those bits, as
    _amax_into does: a float max would drop a NaN, which must be the amax, as torch's."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    acc = tl.zeros((BLOCK_K,), dtype=tl.int32)
    start = tl.program_id(1) * BLOCK_M
    while start < N:
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < N)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=mask,
                    other=0.0)
        bits = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)     # (BLOCK_M, BLOCK_K)
        acc = tl.maximum(acc, tl.max(bits, axis=0))
        start += tl.num_programs(1) * BLOCK_M
    if PER_COLUMN:
        tl.atomic_max(out_ptr + cols, acc, mask=col_ok)
    else:
        tl.atomic_max(out_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast(x_ptr, amax_ptr, q_ptr, qt_ptr, s_ptr, seen_ptr, N, K, stride,
          SCALING: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
          RECORD: tl.constexpr, SLOTS: tl.constexpr, SLOT_STRIDE: tl.constexpr,
          EXACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
          MIN_EXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_K) tile: scale from the given amax (one, per row or per column),
    q = fp8(x / scale) stored as (N, K) rows (WRITE_Q) and/or as (K, N) rows of q^T
    (WRITE_QT). The scales are stored by the first program along the other axis. RECORD:
    the tile's largest |x| atomically maxed into one of seen_ptr's SLOTS int32 bits (delayed
    scaling's amax for the next step, delayed.py)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < N, cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    if SCALING == 0:
        scale, inv = _scales(tl.load(amax_ptr), FP8_MAX)
        v = x.to(tl.float32) * inv
        if (pid_m == 0) & (pid_k == 0):
            tl.store(s_ptr, scale)
    elif SCALING == 1:
        scale, inv = _scales(tl.load(amax_ptr + rows, mask=row_ok, other=1.0), FP8_MAX)
        v = x.to(tl.float32) * inv[:, None]
        if pid_k == 0:
            tl.store(s_ptr + rows, scale, mask=row_ok)
    else:
        scale, inv = _scales(tl.load(amax_ptr + cols, mask=col_ok, other=1.0), FP8_MAX)
        v = x.to(tl.float32) * inv[None, :]
        if pid_m == 0:
            tl.store(s_ptr + cols, scale, mask=col_ok)
    if RECORD:                       # masked elements are 0
        _amax_into_slot(seen_ptr, x.to(tl.float32), SLOTS, SLOT_STRIDE)
    q = _fp8_values(v, EXACT_ROUND, FP8_MAX, MANTISSA, MIN_EXP)
    if WRITE_Q:
        tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=mask)
    if WRITE_QT:
        # converted to FP8 before the transpose: one byte a value through it, not four
        qt = tl.trans(q.to(qt_ptr.dtype.element_ty))
        tl.store(qt_ptr + cols64[:, None] * N + rows[None, :], qt,
                 mask=col_ok[:, None] & row_ok[None, :])


# Tiles measured on an H200 (bench/fp8_cast_tiles.py; bench/NOTES.md), and small ones for the
# interpreter on CPU, so that the tests' small operands walk every loop, mask and atomic.
TILES = {   # kernel: (BLOCK_M, BLOCK_K, num_warps) on the GPU, on CPU
    "rowwise": ((1, 2048, 8), (8, 64, 1)),        # one row: its second read hits L2
    "amax": ((64, 512, 4), (16, 64, 1)),          # 32K values a step, a 64 KB load in flight
    "cast": ((128, 128, 4), (32, 32, 1)),         # q and q^T rows 128 bytes: whole lines
    # the cast that also takes x's amax (delayed scaling): the tile's max of 128 values a
    # thread made the cast above 20% slower at K = 960 and 1600; 32 a thread is not
    "cast_recording": ((64, 64, 4), (32, 32, 1)),
}
AMAX_PROGRAMS_PER_SM = 8        # row programs per SM per column block: enough loads in flight


def _tile(kernel, x):
    return TILES[kernel][0 if x.is_cuda else 1]


def record_slots(record):
    """(SLOTS, SLOT_STRIDE) of a record buffer: a site's (slots, stride) int32 rows
    (delayed.py), or one place."""
    return tuple(record.shape) if record is not None and record.dim() == 2 else (1, 1)


def _unit_columns(x):
    return x if x.stride(1) == 1 else x.contiguous()


def quantize_rows(x, fp8_dtype):
    """(q (N, K), scale (N, 1)): per-row scales, one kernel."""
    x = _unit_columns(x)
    (N, K), (bm, bk, warps) = x.shape, _tile("rowwise", x)
    q = torch.empty((N, K), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((N, 1), dtype=torch.float32, device=x.device)
    fp8_max, mantissa, min_exp = FORMATS[fp8_dtype]
    _rowwise[(triton.cdiv(N, bm),)](x, q, scale, N, K, x.stride(0), AMAX_ONLY=False,
                                    EXACT_ROUND=not x.is_cuda, FP8_MAX=fp8_max,
                                    MANTISSA=mantissa, MIN_EXP=min_exp,
                                    BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
    return q, scale


def amax(x, scaling: int):
    """fp32 amax of x (N, K): () for TENSOR, (N, 1) per ROW, (K, 1) per COLUMN."""
    x = _unit_columns(x)
    N, K = x.shape
    if scaling == ROW:
        bm, bk, warps = _tile("rowwise", x)
        out = torch.empty((N, 1), dtype=torch.float32, device=x.device)
        _rowwise[(triton.cdiv(N, bm),)](x, x, out, N, K, x.stride(0), AMAX_ONLY=True,
                                        EXACT_ROUND=False, FP8_MAX=1.0, MANTISSA=0, MIN_EXP=0,
                                        BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        return out
    bm, bk, warps = _tile("amax", x)
    col_blocks, row_blocks = triton.cdiv(K, bk), triton.cdiv(N, bm)
    # enough programs to fill the GPU, at least 2 per column block on CPU so the tests walk
    # the strided loop and the atomics
    slots = AMAX_PROGRAMS_PER_SM * _sm_count(x.device) if x.is_cuda else 2 * col_blocks
    programs = max(1, min(row_blocks, slots // col_blocks))
    bits = torch.zeros((K, 1) if scaling == COLUMN else (), dtype=torch.int32, device=x.device)
    _amax[(col_blocks, programs)](x, bits, N, K, x.stride(0), PER_COLUMN=scaling == COLUMN,
                                  BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
    return bits.view(torch.float32)


def cast(x, amax_, fp8_dtype, scaling: int, rows: bool = True, transposed: bool = False,
         record=None, out=None):
    """(q (N, K) or None, q^T (K, N) or None, scale) from a given amax (shaped as `amax`
    returns it; all-reduced already where another rank holds part of what it spans).
    `record`: int32 bits that receive max |x| (atomic max; a scalar, or a delayed site's
    slots, `record_slots`), or None. `out`: (q, q^T, scale) to write into (contiguous; None
    where not asked for), or None."""
    x = _unit_columns(x)
    if x.is_cuda and x.dtype == torch.float32 and rows and transposed:
        # Measured on an H200 (Triton 3.6): from an fp32 x, the kernel that writes both q and
        # q^T stores q^T wrong (rows of one repeated byte), whatever the tile; each alone is
        # right. FP8 training casts bf16 (fp32 comes from the tests' fp32 models), so the
        # second pass costs no real run anything.
        q_out, qt_out, s_out = out or (None, None, None)
        q, _, scale = cast(x, amax_, fp8_dtype, scaling, rows=True, record=record,
                           out=out and (q_out, None, s_out))
        qt = cast(x, amax_, fp8_dtype, scaling, rows=False, transposed=True,
                  out=out and (None, qt_out, s_out))[1]
        return q, qt, scale
    (N, K), (bm, bk, warps) = x.shape, _tile("cast" if record is None else "cast_recording", x)
    slots, slot_stride = record_slots(record)
    if out is not None:
        q, qt, scale = out
    else:
        q = torch.empty((N, K), dtype=fp8_dtype, device=x.device) if rows else None
        qt = torch.empty((K, N), dtype=fp8_dtype, device=x.device) if transposed else None
        scale = torch.empty_like(amax_)
    fp8_max, mantissa, min_exp = FORMATS[fp8_dtype]
    _cast[(triton.cdiv(N, bm), triton.cdiv(K, bk))](
        x, amax_, x if q is None else q, x if qt is None else qt, scale,
        amax_ if record is None else record, N, K, x.stride(0), SCALING=scaling,
        WRITE_Q=rows, WRITE_QT=transposed, RECORD=record is not None,
        SLOTS=slots, SLOT_STRIDE=slot_stride,
        EXACT_ROUND=not x.is_cuda,
        FP8_MAX=fp8_max, MANTISSA=mantissa, MIN_EXP=min_exp, BLOCK_M=bm, BLOCK_K=bk,
        num_warps=warps)
    return q, qt, scale


def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count
