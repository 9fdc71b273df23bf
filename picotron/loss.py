"""The loss for any layout: mean next-token cross-entropy over the tokens, in fp32.

    build_loss(pgm) -> loss(logits, targets)

logits (B, T, V) and targets (B, T) global token ids; a target equal to IGNORE_INDEX adds no
loss. With tensor parallelism the head's logits are sharded over the vocabulary, (B, T, V/tp)
on each rank, and the loss is taken from the shards without gathering them (below).

Vocab-parallel cross-entropy (Megatron-LM, section 3), for logits sharded over the
vocabulary.

Shapes: N = B*T tokens, V_local = ceil(V/tp) logit columns per rank (column j of TP rank r is
token r*V_local + j; padding columns past V hold -inf).

For one token with logits z and target t:
    loss = log(sum_v exp(z_v)) - z_t = log(sum_v exp(z_v - m)) - (z_t - m),  m = max_v z_v.
Every term is a sum or a max over v, so each rank reduces its own columns and two all-reduces
of N numbers finish the job: a MAX for m, then one SUM of the stacked pair (local sum of
exp(z - m), local z_t - m, which is 0 where t is another rank's token).
The gradient needs no communication at all: dloss/dz_v = softmax(z)_v - [v == t], and each
rank already holds the global denominator of its own columns' softmax.
"""
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100        # as torch's cross_entropy: targets equal to it add no loss


def causal_lm_loss(logits, targets):
    """Mean cross-entropy over the counted tokens, in fp32. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        # logits (N, V_local) fp32, targets (N,) global token ids.
        v_local = logits.shape[-1]
        start = dist.get_rank(group) * v_local
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < v_local)               # (N,): target on this rank

        m = logits.max(dim=-1).values                              # (N,), the stabiliser
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - m[:, None]).exp()                          # (N, V_local); -inf -> 0
        target_logit = logits.gather(1, local_t.clamp(0, v_local - 1)[:, None]).squeeze(1)
        target_logit = torch.where(mine, target_logit - m, 0.0)    # (N,)
        sums = torch.stack([exp.sum(dim=-1), target_logit])        # (2, N)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = sums

        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        losses = torch.where(valid, sum_exp.log() - target_logit, 0.0)   # (N,)
        softmax = exp.div_(sum_exp[:, None])                       # (N, V_local), in place
        ctx.save_for_backward(softmax, local_t, mine & valid, valid, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, hit, valid, count = ctx.saved_tensors
        # d mean / dz = (softmax - onehot(t)) / count for the valid tokens, 0 for the ignored.
        grad_logits = softmax * valid[:, None]
        # one (row, column) per token, minus 0 where the target is another rank's (or ignored):
        # no .nonzero(), whose data-dependent size would make the host wait for the GPU
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_t.clamp(0, grad_logits.shape[1] - 1)] -= hit.float()
        return grad_logits * (grad / count), None, None


def vocab_parallel_cross_entropy(logits, targets, group):
    """Mean cross-entropy over the tokens, in fp32, from vocab-sharded logits.

    logits (B, T, V_local) this rank's columns, targets (B, T) global ids, replicated over TP.
    Forward: a MAX and a SUM all-reduce of (B*T) numbers. Backward: no communication; the
    gradient of the logits stays sharded like them. Equals `causal_lm_loss` (above) on
    the gathered logits."""
    return _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets.flatten(),
                                            group)


def build_loss(pgm):
    """loss(logits, targets) for this layout: vocab-parallel when the logits are sharded over
    tensor parallelism, plain cross-entropy otherwise."""
    if pgm.tp_size > 1:
        return partial(vocab_parallel_cross_entropy, group=pgm.tp_group)
    return causal_lm_loss
