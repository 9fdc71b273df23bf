"""The attention functions a model can be built with (`model.attn_implementation`).

Each takes q (B, H, T, D), k and v (B, K, T, D) and returns (B, H, T, D), causal: the
positions are already in q and k (RoPE), and the causal order is the sequence's order. H may be a
multiple of K (grouped-query attention): query head h reads kv head h // (H/K).
"""
import importlib.util
import math

import torch
import torch.nn.functional as F

from picotron.config import MissingPackage


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
    has_flash = importlib.util.find_spec("flash_attn") is not None
    return "flash_attention_2" if has_flash and device_type == "cuda" else "sdpa"


def resolve_attention(name: str, device_type: str):
    """The attention function for `model.attn_implementation` on this device. Asked for by
    name, flash-attn must be importable now, not at the first forward."""
    name = resolved_name(name, device_type)
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise MissingPackage("model.attn_implementation='flash_attention_2'", "flash-attn "
                             "(`pip install flash-attn`)", "or use 'sdpa' ('auto' takes "
                             "flash-attn when it is installed)", "no module named flash_attn")
    return {"eager": eager_attention, "sdpa": sdpa_attention,
            "flash_attention_2": flash_attention}[name]


# SDPA's kernels, by the names of torch.nn.attention.SDPBackend
SDPA_KERNELS = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION":
                "memory-efficient", "CUDNN_ATTENTION": "cuDNN", "OVERRIDEABLE": "a backend's own"}


def sdpa_kernel(heads: int, kv_heads: int, seq: int, head_dim: int, dtype, device,
                contiguous: bool = False):
    """Which of its kernels SDPA runs in training for one sequence of this shape, or None where
    torch cannot say (the choice is a private function of torch's). It picks by device, dtype,
    head size, sequence length, layout and whether gradients are needed, so it is asked with
    empty tensors that need them, laid out as the model's projections leave q, k and v: (1, T,
    H, D) viewed as (1, H, T, D), or (1, H, T, D) itself where `contiguous` (Ulysses)."""
    from torch.nn.attention import SDPBackend

    def probe(n):
        if contiguous:
            return torch.empty(1, n, seq, head_dim, dtype=dtype, device=device,
                               requires_grad=True)
        return torch.empty(1, seq, n, head_dim, dtype=dtype, device=device,
                           requires_grad=True).transpose(1, 2)
    q, k = probe(heads), probe(kv_heads)
    try:        # a private function of torch's: a line of the run's report must not end it
        choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=heads != kv_heads)
    except (AttributeError, RuntimeError, TypeError):
        return None
    finally:
        del q, k
        if device.type == "cuda":       # the probe's blocks: not kept in this rank's cache
            torch.cuda.empty_cache()
    names = {backend.value: name for name, backend in SDPBackend.__members__.items()}
    return SDPA_KERNELS.get(names.get(choice), f"SDPBackend {choice}")
