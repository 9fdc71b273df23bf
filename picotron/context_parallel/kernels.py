"""Attention on one (query block, key/value block) pair, returning what ring attention merges.

Legend as in model.py: B batch, H query heads, K key/value heads (G = H/K queries per kv head),
Tq query rows of the block, Tk key rows, D head dim.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers") never holds the
whole sequence's keys: it computes attention block by block and merges. For that a block must
return, besides its output, the log-sum-exp of each query row's scores:

    lse_i = log sum_j exp(s_ij)          out_i = sum_j exp(s_ij - lse_i) v_j

Two blocks (out1, lse1), (out2, lse2) of the same rows then combine exactly into the attention
over the union of their keys; see `merge` in ring_attention.py. The backward pass needs no
stored probabilities either: with the *final* out and lse of a row, each block's share of the
gradient can be recomputed alone (FlashAttention-2's backward, Dao 2023).

Each direction has a fused version (PyTorch's own kernels: flash on CPU, memory-efficient on
CUDA; they return and accept the LSE) and the plain reference, the oracle the tests compare to.

`causal` here means the lower-triangular mask of a square block whose queries and keys are the
same positions (the diagonal blocks); off-diagonal blocks are either fully visible or skipped
by the caller, so no other mask is ever needed.
"""
import math

import torch


def _grouped(q, k, v):
    """View q as (B, K, G, Tq, D) and k, v as (B, K, 1, Tk, D) in fp32, so that query head h
    meets kv head h // G by broadcasting: the K kv heads are never copied G times."""
    B, H, Tq, D = q.shape
    K = k.shape[1]
    return (q.float().reshape(B, K, H // K, Tq, D), k.float()[:, :, None], v.float()[:, :, None])


def _scores(qg, kg, causal: bool):
    """Scaled scores (B, K, G, Tq, Tk) in fp32, the diagonal block masked causally."""
    s = (qg @ kg.transpose(-2, -1)) / math.sqrt(qg.shape[-1])
    if causal:
        Tq, Tk = s.shape[-2:]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def reference_block_forward(q, k, v, causal: bool):
    """The readable oracle. q (B, H, Tq, D), k and v (B, K, Tk, D) ->
    out (B, H, Tq, D) fp32, lse (B, H, Tq) fp32 (natural log)."""
    B, H, Tq, D = q.shape
    qg, kg, vg = _grouped(q, k, v)
    s = _scores(qg, kg, causal)                                     # (B, K, G, Tq, Tk)
    lse = s.logsumexp(-1)                                           # (B, K, G, Tq)
    out = torch.exp(s - lse[..., None]) @ vg                        # (B, K, G, Tq, D)
    return out.reshape(B, H, Tq, D), lse.reshape(B, H, Tq)


def fused_block_forward(q, k, v, causal: bool):
    """The same through PyTorch's fused attention kernels, which also return the LSE.

    On CUDA: the memory-efficient kernel (any dtype, fp32 included); its LSE is padded to a
    multiple of 32 rows, hence the slice. On CPU: the flash kernel for CPU. Both give the LSE in
    natural log (flash-attn's kernels work in log2 internally but also return natural log) and
    want as many kv heads as query heads, so k and v are expanded here, after they travelled."""
    B, H, Tq, D = q.shape
    groups = H // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(D)
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    return out.float(), lse[..., :Tq].float()


def reference_block_backward(q, k, v, dout, out, lse, causal: bool):
    """Gradients of one block's share of the loss, recomputed from the final statistics.

    q, dout, out (B, H, Tq, D); k, v (B, K, Tk, D); lse (B, H, Tq) fp32. out and lse are the
    row's FINAL output and log-sum-exp over all its keys (all blocks). Then p_ij =
    exp(s_ij - lse_i) is the row's true probability and, with delta_i = sum_d dout_id out_id,
        dv = p^T dout,   ds = p * (dout v^T - delta),   dq = ds k / sqrt(D),   dk = ds^T q / sqrt(D)
    are exactly this block's terms of the full gradient. Returns dq (B, H, Tq, D) and
    dk, dv (B, K, Tk, D), all fp32; dk and dv are summed over the G query heads of a kv head."""
    B, H, Tq, D = q.shape
    K = k.shape[1]
    qg, kg, vg = _grouped(q, k, v)
    dog = dout.float().reshape(B, K, H // K, Tq, D)
    delta = (dout.float() * out.float()).sum(-1).reshape(B, K, H // K, Tq, 1)
    s = _scores(qg, kg, causal)                                     # (B, K, G, Tq, Tk)
    p = torch.exp(s - lse.reshape(B, K, H // K, Tq, 1))
    dv = (p.transpose(-2, -1) @ dog).sum(2)                         # (B, K, Tk, D)
    ds = p * (dog @ vg.transpose(-2, -1) - delta)
    dq = (ds @ kg) / math.sqrt(D)                                   # (B, K, G, Tq, D)
    dk = (ds.transpose(-2, -1) @ qg).sum(2) / math.sqrt(D)          # (B, K, Tk, D)
    return dq.reshape(B, H, Tq, D), dk, dv


def fused_block_backward(q, k, v, dout, out, lse, causal: bool):
    """The same through the fused kernels' backward, which take (out, lse) as saved by their
    forward: given the final ones, they return this block's share, as the reference does.
    The CUDA kernel reads its LSE padded to a multiple of 32 rows, as its forward wrote it."""
    B, H, Tq, D = q.shape
    K = k.shape[1]
    if H > K:
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scale, dout, out = 1.0 / math.sqrt(D), dout.to(q.dtype), out.to(q.dtype)
    if q.is_cuda:
        padded = lse.new_zeros(B, H, -(-Tq // 32) * 32)
        padded[..., :Tq] = lse
        seed = offset = torch.zeros((), dtype=torch.int64)        # unused without dropout
        # The kernel wants the (B, T, H, D) memory layout its forward produces: given
        # (B, H, T, D)-contiguous bf16 tensors it silently returned NaN dq/dk (checked on H200).
        dout, q, k, v, out = (t.transpose(1, 2).contiguous().transpose(1, 2)
                              for t in (dout, q, k, v, out))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False],
            causal, scale=scale)[:3]
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    # Expanded kv heads: the G query heads of one kv head add up their gradients.
    dk, dv = (t.float().reshape(B, K, H // K, -1, D).sum(2) for t in (dk, dv))
    return dq.float(), dk, dv
