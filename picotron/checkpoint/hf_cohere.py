"""PaLM-style models <-> transformers' CohereForCausalLM, the Hugging Face model that computes
the PaLM block (Chowdhery et al. 2022): x + attn(n(x)) + mlp(n(x)) with ONE shared bias-free
LayerNorm n, SwiGLU, grouped or multi-query attention, a tied head.

Cohere computes our function exactly when:
- `logit_scale` = 1 (Cohere multiplies the logits by it; released models use 0.0625);
- `use_qk_norm` = false, `attention_bias` = false (we have neither);
- its LayerNorm (mean-centred, gain only, no bias, fp32 statistics, eps `layer_norm_eps`) is
  ours with eps `rms_norm_eps`, shared by attention and MLP, and final norm the same;
- RoPE pairs the same coordinates. Ours rotates the pairs (x_i, x_{i+D/2}) by angle
  theta_i (halves, as Llama); Cohere rotates (x_{2i}, x_{2i+1}) by theta_i (interleaved).
  So each head's q and k output rows are reordered: Cohere row 2i is our row i, Cohere row
  2i+1 is our row i + D/2. q.k is unchanged when q and k are permuted alike, so attention,
  and everything after it, is the same; v and o keep their order.
Parameter names are the Llama ones (embed_tokens, layers.N.input_layernorm,
self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, norm, lm_head); Cohere has no
post_attention_layernorm, nor do we in the parallel block.
"""
import torch

from picotron.checkpoint.shards import CheckpointError


def check_exportable(m) -> None:
    """Only the two blocks transformers has: Llama (sequential, RMSNorm) and PaLM-style
    (parallel, LayerNorm: Cohere)."""
    if m.parallel_residual != (m.norm_type == "layernorm"):
        raise CheckpointError(
            f"this checkpoint mixes the two blocks (parallel_residual={m.parallel_residual}, "
            f"norm_type={m.norm_type!r}): Llama is sequential with RMSNorm, the PaLM-style "
            f"block (transformers' CohereForCausalLM) parallel with LayerNorm; no model in "
            f"transformers computes this one, so export is refused")


def is_palm_style(m) -> bool:
    return m.parallel_residual and m.norm_type == "layernorm"


def rope_order(head_dim: int) -> torch.Tensor:
    """Our row index for each Cohere row of one head: [0, D/2, 1, D/2+1, ...]."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def to_cohere_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(heads*D, C) q or k projection in our RoPE order -> Cohere's interleaved order."""
    rows = weight.view(-1, head_dim, weight.shape[-1])            # (heads, D, C)
    return rows[:, rope_order(head_dim)].reshape(weight.shape)


def from_cohere_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse: Cohere's interleaved rows -> ours. `weight` may be this rank's slice of
    the rows, as long as it holds whole heads (tensor parallelism splits by heads)."""
    rows = weight.view(-1, head_dim, weight.shape[-1])
    inverse = torch.argsort(rope_order(head_dim))
    return rows[:, inverse].reshape(weight.shape)


def is_rope_rotated(name: str) -> bool:
    return name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))


def cohere_weights(weights: dict, head_dim: int) -> dict:
    """{our name: tensor} -> the same tensors with q/k rows in Cohere's order."""
    return {n: to_cohere_rows(t, head_dim) if is_rope_rotated(n) else t
            for n, t in weights.items()}


def cohere_config(model: dict, dtype: str, bos, eos) -> dict:
    """config.json of the equivalent CohereForCausalLM."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rope_theta", "tie_word_embeddings", "initializer_range")
    return {"architectures": ["CohereForCausalLM"], "model_type": "cohere",
            **{k: model[k] for k in keys}, "layer_norm_eps": model["rms_norm_eps"],
            "logit_scale": 1.0, "use_qk_norm": False, "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
            # no padding row: Cohere's embedding would zero that token's gradient
            "pad_token_id": None, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": dtype, "use_cache": True}
