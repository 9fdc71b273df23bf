"""`training.fused_loss = "triton"`: the output head and the cross-entropy a chunk of tokens at a
time, as "chunked" in loss.py, with each chunk's loss and logit gradient from one Triton kernel
and nothing that makes the host wait for the GPU.

Why our own rather than liger's fused linear cross-entropy: liger reads the number of counted
tokens with `.item()` before its kernel (an int argument) and compares grad_output with 1.0
(`torch.equal`) in backward, i.e. two host syncs per step. Each one drains the queue of
launched kernels; the GPU then idles while the host launches the next ones (a
profile at 360M showed a 1.1 ms gap and a run of 0.2-0.3 ms gaps per step around it).
Here the token count stays a device scalar, and backward always multiplies by
grad_output / count, computed on the device.

Per chunk of `rows` tokens (N tokens in all, C hidden, V vocab):
    logits = h @ W^T          (rows, V) bf16, one buffer reused by every chunk
    kernel, one program per row, two passes over it:
        lse = logsumexp(fp32 logits); loss_row = lse - logit[target]     (0 if ignored)
        logits <- softmax - onehot(target), in place                       (0 if ignored)
    grad_hidden[chunk] = g @ W           (rows, C)
    grad_weight += g^T @ h               (V, C), fp32 (an fp32-output addmm on CUDA)
The loss is the last op of the step, so d loss / d logits is known in forward; backward only
multiplies the stored gradients by grad_output / count, in fp32 (they are per token, not yet
divided by the token count: loss.py says why, fp16). Same arithmetic as liger and "chunked":
bf16 logits from a bf16 matmul, fp32 softmax, bf16 logit gradients. Tests:
tests/test_triton_loss.py (CPU interpreter and GPU, against torch's cross_entropy),
tests/test_speed.py (fp16) and tests/test_kernels_gpu.py.
"""
import torch
import triton
import triton.language as tl

from picotron.loss import IGNORE_INDEX


@triton.jit
def _cross_entropy_rows(logits_ptr, targets_ptr, loss_ptr, stride, ignore_index,
                        n_cols: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # n_cols (the vocabulary) is a compile-time constant: one compilation per model
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride                 # this row's (V,) logits
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    # read before pass 2 overwrites the row with gradients
    target_logit = tl.load(base + target, mask=valid, other=0.0).to(tl.float32)
    offsets = tl.arange(0, BLOCK)
    # Pass 1: running max m and running sum s of exp(x - m) (online softmax), fp32.
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    if HAS_GRAD:
        # Pass 2: d loss_row / d logits = softmax - onehot(target), over the same row.
        scale = tl.where(valid, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    # liger-kernel's choice for the same row pass (up to 32768 columns per iteration, 32 warps):
    # V = 49152 takes two iterations per pass.
    return min(32768, triton.next_power_of_2(n_cols))


def cross_entropy_rows_(logits, targets, loss, with_grad: bool = True):
    """logits (n, V), contiguous rows; targets (n,). Writes each row's loss into `loss` (n,)
    fp32; with_grad overwrites logits with d sum(loss) / d logits."""
    _cross_entropy_rows[(logits.shape[0],)](
        logits, targets, loss, logits.stride(0), IGNORE_INDEX, n_cols=logits.shape[1],
        HAS_GRAD=with_grad, BLOCK=_block(logits.shape[1]), num_warps=32)


@triton.jit
def _scale(x_ptr, out_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    # out = x * factor, in fp32, one rounding to out's dtype; factor a device scalar
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (x * tl.load(factor_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


def scaled(x, factor):
    """x * factor for a contiguous x and an fp32 0-dim device tensor, computed in fp32.
    (torch's `x * factor` would round factor to x's dtype first: 1 / count in bf16 is off by
    up to 2^-9, the same way for every gradient.)"""
    out = torch.empty_like(x)
    if x.numel():
        _scale[(triton.cdiv(x.numel(), 4096),)](x, out, factor, x.numel(), BLOCK=4096,
                                                num_warps=8)
    return out


def _accumulate(grad_weight, g_t, h):
    """grad_weight (V, C) fp32 += g_t (V, rows) @ h (rows, C), bf16 inputs."""
    if grad_weight.device.type == "cuda" and g_t.dtype != torch.float32:
        # cuBLAS accumulates in fp32 and writes fp32: no bf16 product, no separate add
        torch.addmm(grad_weight, g_t, h, out_dtype=torch.float32, out=grad_weight)
    else:                       # CPU has no mixed-dtype addmm
        grad_weight += (g_t @ h).float()


class _TritonLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows: int, need_grad: bool):
        # hidden (N, C), weight (V, C), targets (N,)
        N, V = hidden.shape[0], weight.shape[0]
        count = (targets != IGNORE_INDEX).sum().clamp(min=1).float()   # stays on the device
        losses = torch.empty(N, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32,
                                  device=weight.device) if need_grad else None
        buffer = torch.empty(min(rows, N), V, dtype=hidden.dtype, device=hidden.device)
        for start in range(0, N, rows):
            h = hidden[start:start + rows]
            logits = torch.mm(h, weight.t(), out=buffer[:h.shape[0]])      # (rows, V)
            cross_entropy_rows_(logits, targets[start:start + rows],
                                losses[start:start + rows], need_grad)
            if need_grad:                    # logits now hold d sum(loss_row) / d logits
                torch.mm(logits, weight, out=grad_hidden[start:start + rows])
                _accumulate(grad_weight, logits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        factor = grad_out.float() / count                # d objective / d sum(loss_row)
        # not in place: a second backward (retain_graph=True) must find them unscaled
        return (scaled(grad_hidden, factor), (grad_weight * factor).to(ctx.weight_dtype),
                None, None, None)


def triton_linear_cross_entropy(hidden, weight, targets, rows: int):
    """Mean cross-entropy of (hidden @ weight^T) against targets, fp32 softmax, no host sync.
    hidden (N, C), weight (V, C), targets (N,); `rows` tokens per chunk."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _TritonLinearCrossEntropy.apply(hidden.contiguous(), weight, targets.contiguous(),
                                           rows, need_grad)
