"""Entering context parallelism: swap every layer's attention for one bound to the cp group.

The model never learns about the ring: `Attention.attention_fn(q, k, v, position_ids)` is the
one seam (see model.py). Everything else of context parallelism happens in the training loop:
`shard_sequence` hands each rank its zigzag share of the tokens, targets and positions, and the
gradients are averaged over the cp*dp group (data_parallel), since cp ranks see different
tokens just as dp ranks do.
"""
import functools

from picotron.context_parallel.ring_attention import ring_attention


def apply_context_parallel(model, pgm, config):
    """Swap each layer's `self_attn.attention_fn` for ring attention over pgm.cp_group.

    Called on the meta-device skeleton, after tensor and pipeline parallelism: it only needs
    the layers this stage kept, whatever heads tensor parallelism left them. cp_size 1 leaves
    the model untouched. The per-block kernel is the fused one unless the config asks for the
    eager reference (model.attn_implementation = "eager")."""
    if pgm.cp_size == 1:
        return model
    fused = config.model.attn_implementation != "eager"
    attention_fn = functools.partial(ring_attention, pgm=pgm, fused=fused)
    for layer in model.layers.values():
        layer.self_attn.attention_fn = attention_fn
    return model
