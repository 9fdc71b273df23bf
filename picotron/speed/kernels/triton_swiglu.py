"""SwiGLU on the packed gate/up projection, in Triton: silu(gate) * up with gate and up the
two halves of one tensor, as fused_linear(x, [gate_proj.weight, up_proj.weight]) makes it.

    gu (..., 2I): gate = gu[..., :I], up = gu[..., I:]  ->  h = silu(gate) * up  (..., I)

Same math as model.py's MLP (F.silu(gate) * up, the reference), with silu and the
product in fp32 and one rounding to gu's dtype; the reference rounds silu(gate) to bf16
before the product, so in bf16 the two differ by about one bf16 step (2^-8 relative) in some
elements. liger's swiglu kernel cannot be used here: it walks a, b and the output with one
row stride, so it cannot read two halves of a (N, 2I) tensor into an (N, I) output.

Memory-bound: forward reads 2I and writes I elements per token; backward reads 3I (gate, up,
dh) and writes 2I. Backward recomputes silu instead of saving it: forward saves gu only.

In-place backward. The gradient d(gu) has gu's shape, and gu is not needed after this
backward, so backward writes d(gu) over the saved gu (as liger does), saving an N x 2I
buffer at the moment of peak memory (1 GiB per layer at 1.7B, B*T = 32768, bf16). This is
safe when nothing else reads gu's values after this backward, which holds when gu is
fused_linear's output consumed only by this op (fused_linear saves x and its weights, not its
output). Guards:
- only a fresh intermediate is overwritten: gu must have a grad_fn, not be a view (its base
  could be read elsewhere) and be contiguous; otherwise backward writes a new tensor;
- after the overwrite gu's version counter is bumped, so any autograd node that saved gu (or
  a view of it) and unpacks it later, or a second backward through this graph
  (retain_graph=True), raises PyTorch's "modified by an inplace operation" error instead of
  reading gradients as activations. What autograd cannot see (reading gu in a hook after
  backward) is not guarded: don't.
- activation checkpointing recomputes forward in backward, and this op then saves and
  overwrites the recomputed gu; under "selective" (picotron/speed/recompute.py) that gu shares
  storage with the saved matmul output, which the recomputation has already handed out and
  nothing reads again. tests/test_fused_projections.py checks both modes against no
  checkpointing.

SwiGLU output recomputed (`swiglu_linear`, training.activation_checkpointing="selective" with
model.kernels="triton"). The down projection y = h @ W_down^T keeps its input h (N, I) for its
weight gradient: 18-20% of a layer's saved activations (168 MB a layer at 360M, 537 MB at
1.7B). swiglu_linear keeps gu and W_down only. Backward computes dh = dy @ W_down first, then
one kernel reads gu and dh and writes d(gu) over gu and h over dh, and dW_down = dy^T @ h.
The price is one more write of N x I elements per layer in backward (6I instead of 5I per
token, ~+20% of this kernel's time), the saving costs no buffer, and h is bitwise the
forward's (the same fp32 ops on the same gu). Measured on an H200 (bench/NOTES.md),
16 x 2048 tokens: the MLP's forward + backward 2.37 -> 2.44 ms at 360M's widths, 15.47 ->
15.54 ms at 1.7B's; a 360M training step 0.9% slower, its peak 30.3 -> 25.6 GB.

`amax` (training.fp8="tensorwise", speed/fp8/fused.py): both kernels can also take the largest
magnitude of what they store (h forward, d(gu) backward, as rounded to their dtype), one
atomic max per program into an int32 scalar (the fp32 bits: for non-negative floats the two
orders agree), so that the tensor's FP8 scale needs no pass of its own over it.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# On an H200 at N = 32768 tokens (bf16) these reach 4.0 TB/s forward and backward at I = 2560,
# 4.1 at I = 8192, against 4.1-4.2 TB/s for a plain copy; other tile shapes from 1 x 1024 to
# 16 x 512 at 4-8 warps were within 2%, and a flat 1-D layout (row = e // I) was 3-5% faster.
ELEMS = 4096        # elements of h per program: 16 per thread at 8 warps (two 16-byte loads)
MAX_BLOCK = 512     # columns per program: divides I = 2560 (360M) and 8192 (1.7B), no tail


@triton.jit
def _swiglu_h(g, u):
    """h = silu(g) * u in fp32: the one formula every kernel here (and speed/fp8/fused.py's) uses,
    so that a recomputed h is bitwise the forward's."""
    return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_grads(g, u, dh):
    """(d gate, d up, h) in fp32: d gate = dh * up * silu'(gate), silu'(g) = s + g s (1 - s)
    with s = sigmoid(g); d up = dh * silu(gate); h by the same ops as _swiglu_h."""
    s = tl.sigmoid(g)
    return dh * u * (s + g * s * (1.0 - s)), dh * (g * s), g * s * u


@triton.jit
def _amax_into(amax_ptr, v):
    """Atomically max the largest |v| (fp32 holding values of the stored dtype) into the
    int32 bits at amax_ptr. Reduced as bits too: a NaN's (0x7fc00000 once its sign is
    cleared) is above every number's, so a NaN is the amax, as torch's amax gives it."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)                       # (ROWS, BLOCK)
    tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _amax_into_slot(slots_ptr, v, SLOTS: tl.constexpr, STRIDE: tl.constexpr):
    """_amax_into one of SLOTS int32 places STRIDE apart, picked by the program's first grid
    index (a reader takes the max over them), so that no one address takes every program's
    atomic (fp8_delayed.SLOTS). SLOTS = 1 is one address."""
    _amax_into(slots_ptr + (tl.program_id(0) % SLOTS) * STRIDE, v)


@triton.jit
def _swiglu_fwd(gu_ptr, h_ptr, amax_ptr, n_rows, n_cols, gu_stride, h_stride,
                ROWS: tl.constexpr, BLOCK: tl.constexpr, AMAX: tl.constexpr):
    # One (ROWS, BLOCK) tile of h; gate at column c of gu, up at column n_cols + c.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)              # (ROWS,)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)            # (BLOCK,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)       # (ROWS, BLOCK)
    rows = rows.to(tl.int64)[:, None]                                # N * 2I may pass 2^31
    gate_ptrs = gu_ptr + rows * gu_stride + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    h = _swiglu_h(g, u).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows * h_stride + cols[None, :], h, mask=mask)
    if AMAX:                                     # masked elements are 0: silu(0) * 0
        _amax_into(amax_ptr, h.to(tl.float32))


@triton.jit
def _swiglu_bwd(dh_ptr, gu_ptr, dgu_ptr, amax_ptr, n_rows, n_cols, dh_stride, gu_stride,
                dgu_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr, STORE_H: tl.constexpr,
                AMAX: tl.constexpr):
    # d(gu) = (d gate, d up) by _swiglu_grads. dgu_ptr may equal gu_ptr: each element is read
    # before it is written, by the same program, and no program reads another's tile. STORE_H:
    # also write h = silu(gate) * up over dh (SwiGLULinear's recomputation; same ops as
    # _swiglu_fwd, so the same bits).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows = rows.to(tl.int64)[:, None]
    gate_ptrs = gu_ptr + rows * gu_stride + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    dh_ptrs = dh_ptr + rows * dh_stride + cols[None, :]
    dh = tl.load(dh_ptrs, mask=mask, other=0.0).to(tl.float32)
    dgate, dup, h = _swiglu_grads(g, u, dh)
    dgate, dup = dgate.to(dgu_ptr.dtype.element_ty), dup.to(dgu_ptr.dtype.element_ty)
    out_ptrs = dgu_ptr + rows * dgu_stride + cols[None, :]
    tl.store(out_ptrs, dgate, mask=mask)
    tl.store(out_ptrs + n_cols, dup, mask=mask)
    if STORE_H:
        tl.store(dh_ptrs, h.to(dh_ptr.dtype.element_ty), mask=mask)
    if AMAX:        # masked elements are 0 (dh = 0 there); one max each: NaNs kept (bits)
        _amax_into(amax_ptr, dgate.to(tl.float32))
        _amax_into(amax_ptr, dup.to(tl.float32))


def _launch(kernel, n_rows, n_cols, *args, **constexprs):
    """Grid: (row blocks, column blocks). Columns in blocks of up to 512 so that any I works
    (I = 16384 is 32 blocks); for small I a program takes several rows instead, ~4096
    elements each either way. Rows on grid axis 0, which allows 2^31 - 1 programs."""
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    rows = min(max(1, ELEMS // block), triton.next_power_of_2(n_rows))
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, block))
    kernel[grid](*args, ROWS=rows, BLOCK=block, num_warps=8 if rows * block >= 2048 else 4,
                 **constexprs)


def _rows(t):
    """t (..., X) as (N, X) rows with unit column stride (a view when t allows it)."""
    return (t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, t.shape[-1])


def _may_overwrite(gu) -> bool:
    """Backward overwrites gu only if it is a fresh, contiguous intermediate (see top)."""
    return gu.grad_fn is not None and gu._base is None and gu.is_contiguous()


def _swiglu_forward(gu2, amax=None):
    """gu2 (N, 2I) -> h (N, I). amax: a zeroed int32 scalar that receives max |h|'s fp32
    bits (top), or None."""
    n, i2 = gu2.shape
    h = torch.empty(n, i2 // 2, dtype=gu2.dtype, device=gu2.device)
    if n > 0:
        _launch(_swiglu_fwd, n, i2 // 2, gu2, h, h if amax is None else amax, n, i2 // 2,
                gu2.stride(0), h.stride(0), AMAX=amax is not None)
    return h


def _swiglu_backward(dh2, gu2, dgu2, store_h: bool, amax=None):
    """dh2 (N, I), gu2 (N, 2I) -> d(gu) into dgu2 (N, 2I); store_h: h into dh2 too. amax: as
    _swiglu_forward's, for max |d(gu)|."""
    n, i2 = gu2.shape
    if n > 0:
        _launch(_swiglu_bwd, n, i2 // 2, dh2, gu2, dgu2, dgu2 if amax is None else amax, n,
                i2 // 2, dh2.stride(0), gu2.stride(0), dgu2.stride(0), STORE_H=store_h,
                AMAX=amax is not None)


class SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        assert gu.shape[-1] % 2 == 0, f"packed gate/up needs an even last dim, got {gu.shape}"
        ctx.inplace = _may_overwrite(gu)
        h = _swiglu_forward(_rows(gu))                                  # (N, I)
        ctx.save_for_backward(gu)
        return h.view(*gu.shape[:-1], h.shape[-1])                      # (..., I)

    @staticmethod
    def backward(ctx, dh):                                              # dh (..., I)
        (gu,) = ctx.saved_tensors
        gu2 = _rows(gu)                                                 # (N, 2I)
        dgu2 = gu2 if ctx.inplace else torch.empty_like(gu2)            # (N, 2I)
        _swiglu_backward(_rows(dh), gu2, dgu2, store_h=False)
        if ctx.inplace:
            torch.autograd.graph.increment_version(gu)   # gu now holds d(gu): trip later readers
        return dgu2.detach().view(gu.shape)


class SwiGLULinear(torch.autograd.Function):
    """y = swiglu(gu) @ w^T: the SwiGLU and the down projection, keeping gu and w, not h."""

    @staticmethod
    def forward(ctx, gu, weight):                                       # gu (..., 2I), w (O, I)
        assert gu.shape[-1] == 2 * weight.shape[1], \
            f"packed gate/up {tuple(gu.shape)} does not match down weight {tuple(weight.shape)}"
        ctx.inplace = _may_overwrite(gu)
        h = _swiglu_forward(_rows(gu))                  # (N, I), freed when forward returns
        ctx.save_for_backward(gu, weight)
        return F.linear(h, weight).view(*gu.shape[:-1], weight.shape[0])   # (..., O)

    @staticmethod
    def backward(ctx, dy):                                              # dy (..., O)
        gu, weight = ctx.saved_tensors
        gu2, dy2 = _rows(gu), dy.reshape(-1, dy.shape[-1])              # (N, 2I), (N, O)
        dgu2 = None
        if ctx.needs_input_grad[0]:
            dh2 = dy2 @ weight                          # (N, I), fresh: h is written over it
            dgu2 = gu2 if ctx.inplace else torch.empty_like(gu2)
            _swiglu_backward(dh2, gu2, dgu2, store_h=True)
            h, dgu2 = dh2, dgu2.detach().view(gu.shape)
            if ctx.inplace:
                torch.autograd.graph.increment_version(gu)
        else:
            h = _swiglu_forward(gu2)
        dw = dy2.t() @ h if ctx.needs_input_grad[1] else None          # (O, N) @ (N, I)
        return dgu2, dw


def swiglu_packed(gu):
    """silu(gu[..., :I]) * gu[..., I:], (..., 2I) -> (..., I). Backward may overwrite gu."""
    return SwiGLUPacked.apply(gu)


def swiglu_linear(gu, weight):
    """swiglu_packed(gu) @ weight^T, (..., 2I) -> (..., O), with swiglu_packed(gu) recomputed
    in backward instead of kept. Backward may overwrite gu."""
    return SwiGLULinear.apply(gu, weight)


def swiglu_packed_reference(gu):
    """The readable version and test oracle: model.py's SwiGLU on the two halves."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_linear_reference(gu, weight):
    """The oracle of swiglu_linear: the packed SwiGLU, then F.linear, h kept by autograd."""
    return F.linear(swiglu_packed(gu), weight)
