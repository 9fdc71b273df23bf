"""apply_tensor_parallel: shard the meta model by the TP plan below (Megatron-LM, Shoeybi et al.
2019), optionally with sequence parallelism (Korthikanti et al. 2022).

Shapes: B batch, T sequence, C hidden, H/K query/kv heads, D head dim, V vocabulary, tp the
tensor-parallel size.

One layer under TP (f: identity forward, all-reduce backward; g: the reverse; see comms.py):

    x (B, T, C) replicated -> norm -> f -> q, k, v   (column: this rank's H/tp and K/tp heads)
                                        -> attention on the local heads, (B, T, H/tp*D)
                                        -> o        (row: partial sums) -> g -> + x
                           -> norm -> f -> gate, up (column: I/tp features) -> down (row) -> g

f sits on the norm's output, once per block, so q, k and v (and, in the PaLM-style parallel
block, gate and up as well) share one backward all-reduce: per layer 2 all-reduces forward and
2 backward for Llama (2 and 1 for PaLM), the count a fused QKV / gate-up projection would give.
Under sequence parallelism everything outside the blocks (residual stream, norms) holds
(B, T/tp, C): f becomes an all-gather along T, g a reduce-scatter, and the norm weights see
only their chunk of the sequence, so their gradients are summed over TP in the data-parallel
gradient buckets (they are marked with `grad_sum_group`). With `distributed.tp_comm_overlap`
each block's all-gather and reduce-scatter run as rings interleaved with its GEMMs
(overlap.py): same numbers, the transfers hidden behind the compute on a GPU.

The embedding is split by vocabulary rows, the head by vocabulary columns; the logits stay
sharded and the loss is taken from them (picotron/loss.py, vocab-parallel cross-entropy).
With tied embeddings the head reuses the embedding's shard. GQA: each rank keeps whole kv
heads, so num_key_value_heads must be divisible by tp (checked in config/checks.py; kv heads are
not replicated).
"""
import fnmatch
from functools import partial

import torch

from picotron.tensor_parallel.comms import enter_tp
from picotron.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding, VocabParallelHead)
from picotron.tensor_parallel.overlap import apply_comm_overlap

# The plan: (module path, style). "*" is any layer index. Norms marked "enter" get f (or the
# SP all-gather) on their output, the one entry into the sharded block that follows them;
# "enter_block" likewise, except under distributed.tp_comm_overlap, where the attention or
# MLP block that follows gathers its input itself, in a ring overlapped with its GEMMs.
TP_PLAN = (
    ("embed_tokens",                      "vocab_embedding"),   # (V/tp, C) rows, then g
    ("layers.*.input_layernorm",          "enter_block"),
    ("layers.*.self_attn.q_proj",         "colwise"),           # C -> H/tp * D
    ("layers.*.self_attn.k_proj",         "colwise"),           # C -> K/tp * D
    ("layers.*.self_attn.v_proj",         "colwise"),           # C -> K/tp * D
    ("layers.*.self_attn.o_proj",         "rowwise"),           # H/tp * D -> C, then g
    ("layers.*.post_attention_layernorm", "enter_block"),       # absent in PaLM-style layers
    ("layers.*.mlp.gate_proj",            "colwise"),           # C -> I/tp
    ("layers.*.mlp.up_proj",              "colwise"),           # C -> I/tp
    ("layers.*.mlp.down_proj",            "rowwise"),           # I/tp -> C, then g
    ("norm",                              "enter"),
    ("lm_head",                           "vocab_head"),        # C -> V/tp logits, no g
)


def _shard(style: str, module, pgm, sequence_parallel: bool, overlap: bool):
    """The module that replaces `module` under `style` (declared on the same device: meta)."""
    rank, size, group = pgm.tp_rank, pgm.tp_size, pgm.tp_group
    if style == "enter_block" and overlap:      # stays (B, T/tp, C): the block's ring gathers
        return module
    if style in ("enter", "enter_block"):   # the norm stays; its output enters the sharded block
        module.register_forward_hook(partial(_enter_after_norm, group=group,
                                             sequence_parallel=sequence_parallel))
        return module
    if style == "vocab_embedding":
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, rank, size,
                                      group, sequence_parallel)
    if module.bias is not None:
        raise NotImplementedError(f"{style} linears without bias only (Llama and PaLM have none)")
    if style == "colwise":
        return ColumnParallelLinear(module.in_features, module.out_features, rank, size)
    if style == "rowwise":
        return RowParallelLinear(module.in_features, module.out_features, rank, size, group,
                                 sequence_parallel)
    if style == "vocab_head":
        return VocabParallelHead(module.in_features, module.out_features, rank, size)
    raise ValueError(f"unknown tensor-parallel style '{style}'")


def _enter_after_norm(module, args, out, group, sequence_parallel):
    """A norm's output enters the sharded block that follows it (f, or the SP all-gather)."""
    return enter_tp(out, group, sequence_parallel)


def apply_tensor_parallel(model, pgm, config):
    """Swap the meta model's modules for sharded ones, in place, following TP_PLAN.

    Called on the meta device, before `materialize`: each sharded parameter carries
    `full_shape` and `local_slice`, so it is initialised as its slice of the full tensor."""
    if pgm.tp_size == 1:
        return model
    sp, overlap = config.distributed.sequence_parallel, config.distributed.tp_comm_overlap
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in TP_PLAN if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        parent_name, _, child = name.rpartition(".")
        with torch.device(next(module.parameters()).device):
            new = _shard(style, module, pgm, sp, overlap)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if overlap:
        apply_comm_overlap(model, pgm.tp_group)      # the blocks' ring versions (overlap.py)
    if config.model.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight     # one (V/tp, C) shard, two uses
    if sp:
        model.register_forward_pre_hook(partial(_full_positions, tp_size=pgm.tp_size),
                                        with_kwargs=True)
        # Under SP each TP rank computes the norm weights' gradients from its own T/tp tokens:
        # the data-parallel buckets sum them over TP (`grad_sum_group`) before averaging
        # over cp_dp. Afterwards they are equal on all TP ranks, so the global gradient norm
        # counts them once (replicated buckets are not summed over TP).
        for p in model.parameters():
            if not hasattr(p, "local_slice"):
                p.grad_sum_group = pgm.tp_group
    return model


def _full_positions(model, args, kwargs, tp_size):
    """Under SP the decoder would read T off its (B, T/tp, C) activations and give RoPE the
    positions of one chunk; attention sees all T tokens (after the all-gather), so pass the
    positions 0..T-1 of the whole sequence unless the caller gave them (context parallel)."""
    x = args[0]
    if kwargs.get("position_ids") is None and len(args) < 2:
        # token ids (B, T) on the first stage, hidden (B, T/tp, C) on a later pipeline stage
        T = x.shape[1] if not torch.is_floating_point(x) else x.shape[1] * tp_size
        kwargs["position_ids"] = torch.arange(T, device=x.device).expand(x.shape[0], T)
    return args, kwargs

