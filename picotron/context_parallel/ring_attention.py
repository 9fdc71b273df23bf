"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"): causal attention over a sequence sharded across the cp group, forward and backward.

Legend as in model.py: B batch, H query heads, K key/value heads, T this rank's tokens (two
zigzag chunks of T/2, see sharding.py), D head dim.

Each rank keeps its queries and passes its keys and values around the ring: at step s it holds
the K/V of rank (cp_rank - s) mod cp, computes that block, and meanwhile already sends it on to
the next rank and receives the following one (the transfer hides behind the compute). After cp
steps every query has met every key. Only the K kv heads travel, never the H query heads.

Which of the four (query chunk, key chunk) pairs a step computes follows from the zigzag split
(rank r holds chunks r and 2cp-1-r; the source rank j holds chunks j and 2cp-1-j):
    j == r  both chunks, causal on the local order (positions increase along it);
    j <  r  chunk j precedes both of ours, chunk 2cp-1-j follows both: all queries x first half
            of the keys, no mask;
    j >  r  both of j's chunks lie between our early and our late chunk: our late half of the
            queries x all keys, no mask.
Every rank so computes 3 chunk pairs at step 0 (two causal diagonals and one full block) and 2
at every other step, 2cp+1 in all: the same work everywhere (tests/test_context_parallel.py
counts them).

Per-block results merge with the log-sum-exp, kept in fp32 whatever the activation dtype: in
bf16 the merge error grows with the ring size and can blow up the backward pass. The backward
pass recomputes each block from the saved q, k, v, the final output and lse (FlashAttention-2
style) and sends each block's dK/dV on around the ring with its K/V; after cp hops they arrive
back at their owner, summed over all ranks' queries.
"""
import torch
import torch.distributed as dist

from picotron.comm import batch_isend_irecv
from picotron.context_parallel.kernels import (fused_block_backward, fused_block_forward,
                                               reference_block_backward, reference_block_forward)


def block_plan(cp_rank: int, src_rank: int, T: int):
    """(query rows, key rows, causal) of this rank's block with the K/V of `src_rank`."""
    half = T // 2
    if src_rank == cp_rank:
        return slice(None), slice(None), True
    if src_rank < cp_rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def ring_exchange(tensor, pgm):
    """Start sending `tensor` to the next cp rank and receiving the previous rank's tensor of
    the same shape; returns a function that waits for both and gives the received tensor.

    The send and the receive are posted as one batch, so two ranks that both send first cannot
    deadlock (NCCL); gloo returns a handle per operation, and all of them are waited on."""
    sent, received = tensor.contiguous(), torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, sent, pgm.cp_send_rank, pgm.cp_group),
           dist.P2POp(dist.irecv, received, pgm.cp_recv_rank, pgm.cp_group)]
    pending = (batch_isend_irecv(ops), sent)    # `sent` lives until its send is done

    def wait():
        for work in pending[0]:
            work.wait()
        return received
    return wait


def merge(out, lse, block_out, block_lse):
    """Fold a block's (out (B, H, t, D), lse (B, H, t)) into the running ones, in place, fp32.

    With new = log(e^lse + e^block_lse) (logaddexp subtracts the running max before exp, so
    nothing overflows), the attention over the union of both key sets is
        out * e^(lse - new) + block_out * e^(block_lse - new)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new)[..., None])
    out.add_(block_out * torch.exp(block_lse - new)[..., None])
    lse.copy_(new)


class RingAttention(torch.autograd.Function):
    """q (B, H, T, D), k and v (B, K, T, D), this rank's zigzag tokens -> out (B, H, T, D)."""

    @staticmethod
    def forward(ctx, q, k, v, pgm, fused: bool):
        cp, rank, T = pgm.cp_size, pgm.cp_rank, q.shape[2]
        assert cp > 1, "cp_size 1 needs no ring: keep the model's own attention function"
        block_forward = fused_block_forward if fused else reference_block_forward
        kv = torch.stack([k, v])                       # (2, B, K, T, D): one message per hop
        out = lse = None
        for step in range(cp):
            if step < cp - 1:                          # prefetch the next block's K/V
                next_kv = ring_exchange(kv, pgm)
            rows, cols, causal = block_plan(rank, (rank - step) % cp, T)
            block_out, block_lse = block_forward(q[:, :, rows], kv[0][:, :, cols],
                                                 kv[1][:, :, cols], causal)
            if out is None:                            # step 0: the diagonal covers every row
                out, lse = block_out, block_lse
            else:
                merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if step < cp - 1:
                kv = next_kv()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pgm, ctx.fused = pgm, fused
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        pgm = ctx.pgm
        cp, rank, T = pgm.cp_size, pgm.cp_rank, q.shape[2]
        block_backward = fused_block_backward if ctx.fused else reference_block_backward
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])                       # (2, B, K, T, D)
        dkv_in_flight = None
        for step in range(cp):
            if step < cp - 1:
                next_kv = ring_exchange(kv, pgm)
            rows, cols, causal = block_plan(rank, (rank - step) % cp, T)
            block_dq, block_dk, block_dv = block_backward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], dout[:, :, rows],
                out[:, :, rows], lse[:, :, rows], causal)
            dq[:, :, rows] += block_dq
            # This block's dK/dV: our share now, then the shares of the ranks it already
            # visited, which the previous rank sent along (fp32, as the merge).
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
            if dkv_in_flight is not None:
                dkv += dkv_in_flight()
            dkv_in_flight = ring_exchange(dkv, pgm)    # on, with the K/V it belongs to
            if step < cp - 1:
                kv = next_kv()
        dkv = dkv_in_flight()        # after cp hops our own block's gradient is back, complete
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, *, pgm, fused: bool = False):
    """The `attention_fn` that context parallelism swaps into every layer.

    It needs no positions: the zigzag layout of the tokens is implied by pgm.cp_rank (their
    positions already went into RoPE). fused picks the per-block kernel (kernels.py)."""
    return RingAttention.apply(q, k, v, pgm, fused)
