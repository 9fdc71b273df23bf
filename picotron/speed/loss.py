"""apply_fused_loss (`training.fused_loss`): the output head and the cross-entropy together, so
the logits of the whole micro-batch never exist at once.

The model's head is swapped for `HeadInLoss`, which keeps the (V, C) weight under its name and
passes the final hidden states (B, T, C) through; the loss returned applies that weight
itself, chunk by chunk. Every caller keeps calling loss_fn(model(x), targets).

The reference (`picotron.loss.causal_lm_loss` on the logits) builds the (N, V) logits in
bf16, an fp32 copy, fp32 log-probabilities and, in backward, an fp32 and a bf16 gradient of
the same size: at N = 16*2048 tokens and V = 49152 that is 3.2 GB per bf16 copy and 6.4 GB
per fp32 one, and several passes of memory traffic over them. Here (N: B*T tokens, C hidden,
V vocab):
- "chunked" (plain PyTorch, any device): the tokens go through the head `rows` at a time;
  each chunk's fp32 logits give its loss AND its gradients right away (the loss is the last
  op, so each token's d loss_row / d logits = softmax - onehot(target) is known in forward),
  and are freed. Backward only scales the stored gradients of the hidden states (N, C) and of
  the head weight (V, C, accumulated in fp32) by grad_output / count.
- "liger": the same scheme with liger-kernel's Triton cross-entropy kernel (fewer passes over
  each chunk); CUDA only.
- "triton": the same scheme with our Triton kernel (speed/kernels/triton_loss.py), which never
  makes the host wait for the GPU (liger's reads the token count with .item()); CUDA only.
Same arithmetic as the reference: bf16 matmul, fp32 softmax; tests/test_speed.py checks loss
and gradients against it.

Why the stored gradients are per token, divided by the token count only in backward: in
fp16, (softmax - onehot) / count for 32k tokens is ~1e-9 for most logits, below fp16's
smallest value (6e-8), so it would round to zero in forward, before backward brings the loss
scale. Per token it stays in range, and backward multiplies by loss_scale / count in fp32
(tests/test_speed.py: fp16 gradients as close as the unfused fp16 loss's). liger's loss
divides in forward and takes no scale, so config_checks refuses it with fp16.
"""
import torch
import torch.nn as nn

from picotron.config import MissingPackage
from picotron.loss import IGNORE_INDEX

DEFAULT_CHUNK_TOKENS = 4096


def default_rows(n_tokens: int) -> int:
    """Tokens per chunk (training.loss_chunk_tokens = 0): 4096, or all of them if fewer.

    Each chunk adds its (V, C) head-weight gradient into the fp32 accumulator: 8*V*C bytes of
    read-modify-write against 6*rows*V*C FLOPs of the chunk's three matmuls, so the
    accumulator costs ~ (8 / 6) * (FLOP/s / bytes/s) / rows of the matmul time: at an H200's
    ~175 FLOP per byte, 23% at 1024 rows, 6% at 4096, whatever V and C; 8192 rows measured
    slower (bench/NOTES.md). liger's rule (a chunk's logits ~ the hidden states' size) spends
    less memory: a (4096, V) bf16 buffer is 400 MB at V = 49152."""
    return min(n_tokens, DEFAULT_CHUNK_TOKENS)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows: int, need_grad: bool):
        # hidden (N, C), weight (V, C), targets (N,)
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32,
                                  device=weight.device) if need_grad else None
        for start in range(0, hidden.shape[0], rows):
            h, t, ok = hidden[start:start + rows], targets[start:start + rows], \
                valid[start:start + rows]
            logits = (h @ weight.t()).float()                       # (rows, V) fp32
            lse = torch.logsumexp(logits, dim=-1)                   # (rows,)
            target_logit = logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
            total += torch.where(ok, lse - target_logit, 0.0).sum()
            if need_grad:
                g = logits.sub_(lse[:, None]).exp_()                # softmax, in place
                # minus one at each counted target (no .nonzero(): it would make the host wait)
                g[torch.arange(len(t), device=g.device), t.clamp(min=0)] -= ok.float()
                g = (g * ok[:, None]).to(hidden.dtype)              # (rows, V) bf16
                grad_hidden[start:start + rows] = g @ weight        # (rows, C)
                grad_weight += (g.t() @ h).float()                  # (V, C)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        factor = grad_out.float() / count                # d objective / d sum(loss_row)
        return ((grad_hidden.float() * factor).to(grad_hidden.dtype),
                (grad_weight * factor).to(ctx.weight_dtype), None, None, None)


def chunked_linear_cross_entropy(hidden, weight, targets, rows: int = None):
    """Mean cross-entropy of (hidden @ weight^T) against targets, fp32 softmax.
    hidden (N, C), weight (V, C), targets (N,)."""
    rows = rows or default_rows(hidden.shape[0])
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, rows, need_grad)


class HeadInLoss(nn.Module):
    """The output head moved into the loss: it holds the head's (V, C) weight (the same
    Parameter, so a tie, its name "lm_head.weight" and what parallelism marked on it stay) and
    passes the final hidden states (B, T, C) through unchanged."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x


class LinearCrossEntropy:
    """loss(hidden (B, T, C), targets (B, T)): the head's weight and the mean cross-entropy in
    one op, the tokens a chunk at a time."""

    def __init__(self, head, impl: str, chunk_tokens: int = 0):
        self.head, self.impl, self.chunk_tokens = head, impl, chunk_tokens
        if impl == "liger":
            try:
                from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            except ImportError as e:
                raise MissingPackage("training.fused_loss='liger'", "liger-kernel on a CUDA "
                                     "machine (`pip install liger-kernel==0.8.5`)",
                                     "or use 'chunked'", e) from None
            self.liger = liger_fused_linear_cross_entropy
        if impl == "triton":
            try:
                from picotron.speed.kernels.triton_loss import triton_linear_cross_entropy
            except ImportError as e:
                raise MissingPackage("training.fused_loss='triton'", "the triton package on a "
                                     "CUDA machine (`pip install triton`)", "or use 'chunked'",
                                     e) from None
            self.triton = triton_linear_cross_entropy

    def __call__(self, hidden, targets):
        weight = self.head.weight
        hidden, targets = hidden.flatten(0, 1), targets.flatten()
        if self.impl == "liger":   # fp32 accumulation of the head's gradient, as "chunked"
            return self.liger(hidden, weight, targets, ignore_index=IGNORE_INDEX,
                              accum_dtype=torch.float32)
        rows = self.chunk_tokens or default_rows(hidden.shape[0])
        if self.impl == "triton":
            return self.triton(hidden, weight, targets, rows)
        return chunked_linear_cross_entropy(hidden, weight, targets, rows)


def apply_fused_loss(model, loss_fn, config):
    """(model, loss_fn) with the head moved into the loss when `training.fused_loss` asks for
    it. A pipeline stage without the head keeps its loss_fn (it never computes a loss). Under
    tensor parallelism the config refuses a fused loss: the vocab-parallel loss already never
    gathers the logits."""
    t = config.training
    if t.fused_loss == "none" or model.lm_head is None:
        return model, loss_fn
    model.lm_head = HeadInLoss(model.lm_head.weight)
    return model, LinearCrossEntropy(model.lm_head, t.fused_loss, t.loss_chunk_tokens)
