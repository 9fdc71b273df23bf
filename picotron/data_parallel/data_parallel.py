"""Gradient averaging over the cp_dp group (the plain reference: one all-reduce per tensor,
after the whole backward pass)."""
import torch.distributed as dist


def sync_gradients(params, pgm) -> None:
    """grad <- mean of grad over the cp_dp group.

    Each rank's loss is the mean over its own 1/(cp*dp) of the global batch's tokens (all
    shares are equal in size), so the mean of the ranks' gradients is the gradient of the
    global mean loss. Needed whenever cp*dp > 1, even with dp = 1: context-parallel ranks
    hold different tokens too."""
    if pgm.cp_dp_size == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=pgm.cp_dp_group)
            p.grad.div_(pgm.cp_dp_size)
