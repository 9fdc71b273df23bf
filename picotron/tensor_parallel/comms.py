"""The four communication operators of tensor parallelism, each an autograd Function whose
backward is the transpose (adjoint) of its forward.

Megatron-LM (Shoeybi et al. 2019, section 3) brackets every sharded block with two operators:
    f: enters the sharded region. Forward: identity (every rank has the full input X).
       Backward: all-reduce (each rank's sharded weights produce only part of dL/dX).
    g: leaves it. Forward: all-reduce (each rank holds a partial sum of the output).
       Backward: identity (dL/dY is the same on every rank).
Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) keeps the activations between
blocks sharded along the sequence, so f and g become:
    f_sp: forward all-gather along T (B, T/tp, C) -> (B, T, C);
          backward reduce-scatter along T (B, T, C) -> (B, T/tp, C).
    g_sp: forward reduce-scatter along T (B, T, C) partial sums -> (B, T/tp, C) full sums;
          backward all-gather along T.
An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes as
plain TP while storing only 1/tp of the activations outside attention and the MLP.

Every function takes the TP process group explicitly. With tp = 1 each is the identity.
"""
import torch
import torch.distributed as dist

from picotron.comm import all_gather_single, reduce_scatter_single


def _all_reduce(x, group):
    """Sum of x over the group, into a new tensor (never modifies an autograd input)."""
    x = x.contiguous().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_gather_seq(x, group):
    """(B, T/tp, ...) -> (B, T, ...): the ranks' chunks concatenated along dim 1 in rank order."""
    tp = dist.get_world_size(group)
    chunk = x.transpose(0, 1).contiguous()                       # (T/tp, B, ...): dim 0 first
    out = torch.empty((tp * chunk.shape[0],) + chunk.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_single(out, chunk, group=group)              # (T, B, ...)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x, group):
    """(B, T, ...) partial sums -> (B, T/tp, ...): this rank's chunk of the sum over ranks."""
    tp = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()                        # (T, B, ...)
    if full.shape[0] % tp:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by tp={tp}")
    out = torch.empty((full.shape[0] // tp,) + full.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)
    return out.transpose(0, 1).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def _is_single(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


def copy_to_tp(x, group):
    """Megatron's f. Forward: identity. Backward: all-reduce (sum) of dL/dx over TP."""
    return x if _is_single(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    """Megatron's g. Forward: all-reduce (sum) of the ranks' partial outputs. Backward:
    identity."""
    return x if _is_single(group) else _ReduceFromTP.apply(x, group)


def gather_from_sequence(x, group):
    """SP's f. Forward: all-gather along T, (B, T/tp, C) -> (B, T, C). Backward:
    reduce-scatter along T, (B, T, C) partial gradients -> (B, T/tp, C) summed."""
    return x if _is_single(group) else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x, group):
    """SP's g. Forward: reduce-scatter along T, (B, T, C) partial sums -> (B, T/tp, C) summed.
    Backward: all-gather along T, (B, T/tp, C) -> (B, T, C)."""
    return x if _is_single(group) else _ReduceScatterToSequence.apply(x, group)


def enter_tp(x, group, sequence_parallel: bool):
    """Into a sharded block: f, or f_sp under sequence parallelism."""
    return gather_from_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


def leave_tp(x, group, sequence_parallel: bool):
    """Out of a sharded block: g, or g_sp under sequence parallelism."""
    return reduce_scatter_to_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)
