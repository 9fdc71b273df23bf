"""The attention functions a model can be built with (`model.attn_implementation`).

Each takes q (B, H, T, D), k and v (B, K, T, D) and returns (B, H, T, D), causal: the
positions are already in q and k (RoPE), and the causal order is the sequence's order. H may be a
multiple of K (grouped-query attention): query head h reads kv head h // (H/K).
"""
import math

import torch
import torch.nn.functional as F

from picotron.config import MissingPackage
from picotron.config.features import flash_attn_installed


def eager_attention(q, k, v):
    """The readable reference: softmax(q k^T / sqrt(D) + causal mask) v.

    q (B, H, T, D), k and v (B, K, T, D); query head h reads kv head h // (H/K)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def sdpa_attention(q, k, v):
    """PyTorch's fused attention (flash / cuDNN / memory-efficient kernels, math on CPU)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


def flash_attention(q, k, v):
    """flash-attn's kernel, which wants (B, T, H, D) and handles GQA itself."""
    from flash_attn import flash_attn_func
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


def resolved_name(name: str, device_type: str) -> str:
    """`model.attn_implementation` with "auto" decided: flash-attn when it is installed and
    the model runs on CUDA, else SDPA."""
    if name != "auto":
        return name
    return "flash_attention_2" if flash_attn_installed() and device_type == "cuda" else "sdpa"


def resolve_attention(name: str, device_type: str):
    """The attention function for `model.attn_implementation` on this device. Asked for by
    name, flash-attn must be importable now, not at the first forward."""
    name = resolved_name(name, device_type)
    if name == "flash_attention_2" and not flash_attn_installed():
        raise MissingPackage("model.attn_implementation='flash_attention_2'", "flash-attn "
                             "(`pip install flash-attn`)", "or use 'sdpa' ('auto' takes "
                             "flash-attn when it is installed)", "no module named flash_attn")
    return {"eager": eager_attention, "sdpa": sdpa_attention,
            "flash_attention_2": flash_attention}[name]

