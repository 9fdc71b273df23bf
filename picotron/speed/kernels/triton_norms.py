"""RMSNorm and bias-free LayerNorm as our own Triton kernels, forward and backward.

Same signatures and numerics as `rms_norm` and `layer_norm` in model.py, which stay the
readable references and the test oracle (tests/test_triton_norms.py, on CPU through Triton's
interpreter and on CUDA). Shapes: x (..., C) is viewed as N rows of C, N = B*T tokens.

What they save:
- over the references: one kernel each way instead of ~6 (upcast, square, mean, rsqrt, scale,
  gain), and backward keeps x and one fp32 rstd (and mean) per row, not fp32 copies of x.
- over liger-kernel's RMSNorm: its backward runs one program per SM that walks the rows one at
  a time, so each SM has one row of x and dy (~4-8 KB) in flight, and takes 3-4x the time of
  the memory traffic (0.22 ms at (32768, 960) bf16 on an H200, for ~190 MB read and written,
  i.e. ~0.05 ms at ~4 TB/s). Here each program loads a tile of BLOCK_M rows at once, several
  programs share each SM, and each keeps its weight-gradient partial in fp32 registers.
Measured on an H200 (bench/norm_tiles.py): at 360M's (32768, 960) the backward moves its
bytes at 83% of the copy rate (54 us a call; liger's took 220), the forward at 83-90%.

The residual form (add_rms_norm, add_layer_norm) also takes the decoder layer's residual add
before its second norm, s = x + delta, and returns s with norm(s): forward, s is written once
and never read back; backward, the residual stream's gradient ds is added inside the norm's
backward instead of by autograd. Three passes over (N, C) fewer a layer, and two launches.

Numerics (as the references): statistics in fp32. RMSNorm uses Llama's casting, (x * rstd)
rounded to x's dtype THEN times the weight, so its output has dtype promote(x, weight).
LayerNorm computes in fp32 with the weight upcast and returns x's dtype. Gradients are
computed in fp32 from x (never from the rounded output) and rounded once.
"""
import functools

import torch
import triton
import triton.language as tl

MAX_C = 8192   # one row must fit in one tile of registers


@triton.jit
def _norm_fwd(x_ptr, d_ptr, s_ptr, w_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, C, x_stride,
              d_stride, eps, RMS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_C: tl.constexpr):
    """One program normalises BLOCK_M rows: x (BLOCK_M, BLOCK_C) -> y, rstd (and mean).
    RESIDUAL: the rows normalised are s = x + d, rounded to x's dtype as torch's add rounds
    it, and s is stored too (the residual stream goes on from it)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < n_rows, cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)   # row * stride can pass 2^31 elements
    x_in = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if RESIDUAL:
        d = tl.load(d_ptr + rows64[:, None] * d_stride + cols[None, :], mask=mask, other=0.0)
        x_in = (x_in.to(tl.float32) + d.to(tl.float32)).to(x_in.dtype)
        tl.store(s_ptr + rows64[:, None] * C + cols[None, :], x_in, mask=mask)
    x = x_in.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if RMS:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)
        # "llama" casting: x * rstd rounded to x's dtype before the gain, as the reference
        xhat = (x * rstd[:, None]).to(x_in.dtype).to(tl.float32)
    else:
        mean = tl.sum(x, axis=1) / C
        xc = tl.where(mask, x - mean[:, None], 0.0)   # padding columns must not count
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / C + eps)
        xhat = xc * rstd[:, None]
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    y = xhat * w[None, :]
    tl.store(y_ptr + rows64[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _norm_bwd(x_ptr, w_ptr, dy_ptr, ds_ptr, dx_ptr, dw_ptr, mean_ptr, rstd_ptr, n_rows, C,
              x_stride, dy_stride, ds_stride, RMS: tl.constexpr, RESIDUAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program p takes row blocks p, p + P, p + 2P, ... (P programs): for each, it writes dx
    (BLOCK_M, C) and adds sum_rows(dy * xhat) to its fp32 dweight partial, stored at the end
    as row p of dw (P, C). With g = dy * w and xhat the normalised x (fp32, per row):
      RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
      LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    RESIDUAL: x is s = x + d, whose output also received a gradient ds: dx + ds is written,
    the gradient of both x and d, in one rounding (the reference rounds dx, then the sum)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    # `while`, not `for ... in range(...)`: Triton 3.6's interpreter cannot take a range with
    # run-time bounds under numpy >= 2.4 (triton-lang/triton#9171); compiled, both are a loop
    start = pid * BLOCK_M
    while start < n_rows:
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x_in = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        x = x_in.to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * dy_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)   # 0 on rows past the end
        g = dy * w[None, :]
        if RMS:
            xhat = x * rstd[:, None]
            # y = w * round(xhat): the weight saw the rounded xhat, as in the forward
            dw += tl.sum(dy * xhat.to(x_in.dtype).to(tl.float32), axis=0)
            dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / C)[:, None])
        else:
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            dw += tl.sum(dy * xhat, axis=0)
            dx = rstd[:, None] * (g - (tl.sum(g, axis=1) / C)[:, None]
                                  - xhat * (tl.sum(g * xhat, axis=1) / C)[:, None])
        if RESIDUAL:
            dx += tl.load(ds_ptr + rows64[:, None] * ds_stride + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        start += tl.num_programs(0) * BLOCK_M
    tl.store(dw_ptr + pid * C + cols, dw, mask=col_ok)


def _tile(C, backward=False):
    """(BLOCK_C, BLOCK_M, num_warps) for rows of C: a tile of BLOCK_M x BLOCK_C = 4K elements,
    small C gets more rows (up to 16). Forward: 8 warps, 16 elements per thread per tensor.
    Backward: 32 per thread (4 warps at 4K), run 4 programs per SM (`_programs`): the
    backward is bound by how many bytes of x and dy each SM has in flight, and swept on an
    H200 (bench/norm_tiles.py, N = 32768) this takes the RMSNorm backward from 110 to 54 us at
    C = 960 (40% -> 83% of the copy-rate floor) and from 113 to 105 us at C = 2048, where 16
    per thread on 2 programs per SM was the choice before. The forward was within 10-17% of
    its floor with every tile tried. (ptxas, sm_90, Triton 3.6: the backward takes 185-255
    registers at 32 per thread and spills at 64.)
    C = 960 -> (1024, 4, 8) forward, (1024, 4, 4) backward; 2048 -> (2048, 2, 8) / (2048, 2, 4)."""
    assert C <= MAX_C, f"C={C}: these kernels hold one row in registers, C <= {MAX_C}"
    BLOCK_C = triton.next_power_of_2(C)
    BLOCK_M = min(16, max(1, 4096 // BLOCK_C))
    per_thread = 32 if backward else 16
    num_warps = min(16, max(1, BLOCK_M * BLOCK_C // (32 * per_thread)))
    return BLOCK_C, BLOCK_M, num_warps


def _programs(device, num_warps, row_blocks):
    """The backward's grid: 16 warps per SM (4 programs of 4 warps), so all programs run in
    one or two equal waves and the (P, C) fp32 partials stay small (2 MB at C = 960). On CPU
    (the interpreter, in tests) 4, so a short test already walks several row blocks per
    program."""
    per_sm = max(1, 16 // num_warps)
    slots = 4 if device.type != "cuda" else per_sm * _sm_count(device)
    return max(1, min(slots, row_blocks))


@functools.lru_cache
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows(t):
    """t (..., C) as an (N, C) view with unit column stride; copies only when no such view
    exists (e.g. a (T, B, C) transpose of a (B, T, C) tensor)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _norm_forward(x, delta, weight, eps, rms):
    """(s, y, saved): y = norm(x) as (N, C), or with `delta` y = norm(s) and s = x + delta
    (else None), and what the backward keeps: the rows normalised, the weight, fp32 mean and
    rstd per row."""
    x2d, weight = _rows(x), weight.contiguous()
    d2d = x2d if delta is None else _rows(delta)
    (N, C), dev = x2d.shape, x.device
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if rms else x.dtype
    y = torch.empty((N, C), dtype=out_dtype, device=dev)
    s = None if delta is None else torch.empty((N, C), dtype=x.dtype, device=dev)
    rstd = torch.empty(N, dtype=torch.float32, device=dev)
    mean = rstd if rms else torch.empty(N, dtype=torch.float32, device=dev)  # RMS: unused
    BLOCK_C, BLOCK_M, num_warps = _tile(C)
    _norm_fwd[(triton.cdiv(N, BLOCK_M),)](
        x2d, d2d, y if s is None else s, weight, y, mean, rstd, N, C, x2d.stride(0),
        d2d.stride(0), eps, RMS=rms, RESIDUAL=s is not None, BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C,
        num_warps=num_warps)
    return s, y, (x2d if s is None else s, weight, mean, rstd)


def _norm_backward(saved, dy, ds, rms):
    """(dx, dweight): the gradients of <norm(x), dy> w.r.t. x and the weight, plus `ds` in dx
    when the input was the residual form's sum s (else None)."""
    x2d, weight, mean, rstd = saved
    dy2d = _rows(dy)
    ds2d = dy2d if ds is None else _rows(ds)
    (N, C), dev = x2d.shape, x2d.device
    # a fresh dx, never dy's memory: an incoming gradient may be read elsewhere too
    dx = torch.empty((N, C), dtype=x2d.dtype, device=dev)
    BLOCK_C, BLOCK_M, num_warps = _tile(C, backward=True)
    programs = _programs(dev, num_warps, triton.cdiv(N, BLOCK_M))
    dw = torch.empty((programs, C), dtype=torch.float32, device=dev)   # every row written
    _norm_bwd[(programs,)](x2d, weight, dy2d, ds2d, dx, dw, mean, rstd, N, C, x2d.stride(0),
                           dy2d.stride(0), ds2d.stride(0), RMS=rms, RESIDUAL=ds is not None,
                           BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C, num_warps=num_warps)
    return dx.view(dy.shape), dw.sum(0).to(weight.dtype)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, rms):
        _, y, saved = _norm_forward(x, None, weight, eps, rms)
        ctx.save_for_backward(*saved)
        ctx.rms = rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return (*_norm_backward(ctx.saved_tensors, dy, None, ctx.rms), None, None)


class _AddNorm(torch.autograd.Function):
    """(s, y) = (x + delta, norm(x + delta)): a decoder layer's residual add and the norm that
    reads its sum, one pass each way. Backward returns ds + d norm / ds to x and delta alike
    (the add passes its gradient to both unchanged)."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps, rms):
        s, y, saved = _norm_forward(x, delta, weight, eps, rms)
        ctx.save_for_backward(*saved)
        ctx.rms = rms
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):
        dx, dw = _norm_backward(ctx.saved_tensors, dy, ds, ctx.rms)
        return dx, dx, dw, None, None


def rms_norm(x, weight, eps: float):
    """x / rms(x) * w with Llama's casting, as model.rms_norm, in one kernel each way."""
    return _Norm.apply(x, weight, eps, True)


def layer_norm(x, weight, eps: float):
    """LayerNorm with a gain and no bias, as model.layer_norm, in one kernel each way."""
    return _Norm.apply(x, weight, eps, False)


def add_rms_norm(x, delta, weight, eps: float):
    """(x + delta, rms_norm(x + delta)), the residual add then model.rms_norm, in one kernel
    each way."""
    return _AddNorm.apply(x, delta, weight, eps, True)


def add_layer_norm(x, delta, weight, eps: float):
    """(x + delta, layer_norm(x + delta)), the residual add then model.layer_norm, in one
    kernel each way."""
    return _AddNorm.apply(x, delta, weight, eps, False)
