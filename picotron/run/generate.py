"""Sampling text from a trained model: temperature, top-k, stop at EOS.

As in the PaLM example's autoregressive wrapper: at each step take the logits of the last
position, keep the k largest (the rest become -inf), divide by the temperature, sample from
the softmax, and stop once EOS is drawn. temperature 0 means greedy (argmax).

There is no KV cache: every new token re-runs the model over the whole sequence so far
(cropped to max_position_embeddings), which costs O(T^2) per step but keeps the model code
free of generation state. That is fine for the small models and short outputs this is for.
"""

import torch

from picotron.attention import eager_attention
from picotron.model import Decoder
from picotron.checkpoint.shards import checkpoint_config, load_full_weights


def load_for_inference(checkpoint_dir: str, device="cpu"):
    """(model in eval mode, its Config) from a checkpoint directory (one step_* folder).
    The textbook model, whatever fast paths the run trained with (they are plug-ins applied
    by train.py, never part of the model): same weights, same math."""
    config = checkpoint_config(checkpoint_dir)
    weights = load_full_weights(checkpoint_dir)
    dtype = next(iter(weights.values())).dtype
    with torch.device("meta"):
        model = Decoder(config.model, eager_attention)
    model.to_empty(device=device)
    if config.model.tie_word_embeddings:      # to_empty broke the tie: tie again
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model.to(dtype).eval(), config


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits (B, V) with all but the k largest per row set to -inf (k <= 0: keep all)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]                  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (B, V) / temperature, finite for any temperature > 0, so that a tiny one samples
    like greedy. The row's max is subtracted first: the likeliest token gets 0 and the others
    a negative number, which a tiny temperature sends to -inf (probability 0) instead of
    overflowing to inf - inf = NaN in the softmax. In fp64: a temperature below fp32's
    smallest number (1e-45) would be 0 there, and 0 / 0 is NaN."""
    logits = logits.double()
    return (logits - logits.max(dim=-1, keepdim=True).values) / temperature


@torch.no_grad()
def sample(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int = 0, eos_token_id: int = None, generator: torch.Generator = None,
           max_len: int = None) -> torch.Tensor:
    """prompt (T0,) token ids -> (T0 + n,) with n <= max_new_tokens new tokens; the EOS that
    ends the sample is kept (as transformers' generate does)."""
    device = next(model.parameters()).device
    seq = prompt.to(device).view(1, -1)                                  # (1, T)
    for _ in range(max_new_tokens):
        context = seq if max_len is None else seq[:, -max_len:]
        logits = model(context)[:, -1, :].float()                        # (1, V)
        if temperature == 0:
            token = logits.argmax(-1, keepdim=True)                      # (1, 1)
        else:
            probs = torch.softmax(scaled_logits(filter_top_k(logits, top_k), temperature), -1)
            token = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        seq = torch.cat([seq, token], dim=1)
        if eos_token_id is not None and token.item() == eos_token_id:
            break
    return seq[0]
