"""Ulysses context parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): trade the sequence
split for a head split around attention, with two all-to-alls.

Legend as in model.py: B batch, H query heads, K kv heads, N either of them, T this rank's
tokens (its zigzag share, see sharding.py), cp ranks, D head dim.

Before attention every rank holds all heads of its T tokens. One all-to-all gives it instead
N/cp heads of all cp*T tokens; it runs ordinary causal attention (the model's own kernel) on
them, and a second all-to-all brings the output back to all heads of its own tokens. Ring
attention sends K/V cp-1 times around; Ulysses moves q, k, v and out once each, but needs the
head counts divisible by cp (config/checks.py refuses the rest).

Query head h reads kv head h // (H/K). Splitting both head lists into cp contiguous groups
keeps each query head with its kv head on the same rank: rank i gets query heads
[i*H/cp, (i+1)*H/cp) and kv heads [i*K/cp, (i+1)*K/cp).
"""
import torch

from picotron.comm import all_to_all_single
from picotron.context_parallel.sharding import zigzag_positions


class _AllToAll(torch.autograd.Function):
    """x (cp, ...) -> y with y[i] = x[my rank] of rank i: piece i goes to rank i.

    This exchange is its own inverse (piece r of rank i goes to rank r and comes back as piece
    i), and the backward of a permutation is its inverse: backward is the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()                  # the collective reads and writes flat memory
        out = torch.empty_like(x)
        all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _gathered_order(T_full: int, cp: int, device):
    """Positions, in the order the all-to-all lays the ranks' shares side by side."""
    return torch.cat([zigzag_positions(T_full, r, cp) for r in range(cp)]).to(device)


def seq_to_heads(x, pgm):
    """(B, N, T, D), all heads of this rank's tokens -> (B, N/cp, cp*T, D), this rank's heads
    of all tokens, in position order."""
    B, N, T, D = x.shape
    cp = pgm.cp_size
    pieces = x.reshape(B, cp, N // cp, T, D).transpose(0, 1)       # (cp, B, N/cp, T, D)
    shares = _AllToAll.apply(pieces, pgm.cp_group)                 # share i: rank i's tokens
    gathered = shares.permute(1, 2, 0, 3, 4).reshape(B, N // cp, cp * T, D)
    order = _gathered_order(cp * T, cp, x.device)
    return gathered[:, :, torch.argsort(order)]                    # zigzag -> position order


def heads_to_seq(x, pgm):
    """The inverse: (B, N/cp, cp*T, D) in position order -> (B, N, T, D) of this rank's tokens."""
    B, n, T_full, D = x.shape
    cp = pgm.cp_size
    gathered = x[:, :, _gathered_order(T_full, cp, x.device)]     # position -> rank shares
    pieces = gathered.reshape(B, n, cp, T_full // cp, D).permute(2, 0, 1, 3, 4)
    heads = _AllToAll.apply(pieces, pgm.cp_group)                  # piece i: head group i
    return heads.transpose(0, 1).reshape(B, cp * n, T_full // cp, D)


def ulysses_attention(q, k, v, *, pgm, attention_fn):
    """q (B, H, T, D), k and v (B, K, T, D) of this rank's tokens -> out (B, H, T, D).

    `attention_fn` is the model's causal attention (eager, sdpa, flash): after the all-to-all
    it sees whole sequences in position order, as on one process."""
    q, k, v = (seq_to_heads(t, pgm) for t in (q, k, v))
    return heads_to_seq(attention_fn(q, k, v), pgm)
