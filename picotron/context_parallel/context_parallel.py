"""Entering context parallelism: swap every layer's attention for one bound to the cp group.

The model never learns about the ring: `Attention.attention_fn(q, k, v)` is the
one seam (see model.py). Everything else of context parallelism happens in the training loop:
`shard_sequence` hands each rank its zigzag share of the tokens, targets and positions, and the
gradients are averaged over the cp*dp group (data_parallel), since cp ranks see different
tokens just as dp ranks do.
"""
import functools

from picotron.context_parallel.ring_attention import ring_attention
from picotron.context_parallel.ulysses import ulysses_attention


def apply_context_parallel(model, pgm, config):
    """Swap each layer's `self_attn.attention_fn` for context-parallel attention over
    pgm.cp_group: ring attention, or Ulysses when distributed.cp_mode = "ulysses".

    Called on the meta-device skeleton, after tensor and pipeline parallelism: it only needs
    the layers this stage kept, whatever heads tensor parallelism left them. cp_size 1 leaves
    the model untouched. Ring attention's per-block kernel is the fused one unless the config
    asks for the eager reference (model.attn_implementation = "eager"); Ulysses wraps the
    layer's own attention function, whichever it is."""
    if pgm.cp_size == 1:
        return model
    fused = config.model.attn_implementation != "eager"
    for layer in model.layers.values():
        attn = layer.self_attn
        if config.distributed.cp_mode == "ulysses":
            attn.attention_fn = functools.partial(ulysses_attention, pgm=pgm,
                                                  attention_fn=attn.attention_fn)
        else:
            attn.attention_fn = functools.partial(ring_attention, pgm=pgm, fused=fused)
    return model
