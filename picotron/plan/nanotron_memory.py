"""nanotron's memory of a layout, pipeline rank by pipeline rank, counted from its source (the
version the Ultra-Scale Playbook benchmarked: nanotron of February 2025, bf16 with gradient
accumulation in fp32, torch's fused AdamW, REDUCE_SCATTER tensor parallelism with its
tp_recompute_allgather, flash-attention 2, its 1F1B engine). A profile names it with the trait
memory = "nanotron" (trainer_memory.py applies the profile's factors and margin).

    rank_parts(config, profile, pp_rank) -> Parts(held, rest, logits) in bytes

held: what lives all step, per parameter of the rank (its blocks by stage_split.py's split
  by compute): the bf16 weights (2 B); the fp32 gradient accumulator, whole even under ZeRO-1
  (4 B: FP32GradientAccumulator's grad_buckets_named_params); when dp > 1, 2 B of bf16 buffers:
  under ZeRO-0 torch DDP's buckets (the reducer allocates them at wrap time), under ZeRO-1,
  which nanotron does not wrap in DDP, the flat buffers its all_gather_coalesced gathers the
  updated parameters into after the step, one per dp rank's shard (the caching allocator
  keeps their segment; the gather's input copy, 2 B / dp, is left out: counting it fits the
  runs no better); and per parameter of the rank's ZeRO shard the fp32 master copy and
  AdamW's two fp32 moments (12 B / dp under ZeRO-1).
rest: at the busier of two moments, with the others in flight alongside: the end of a forward
  (that micro-batch's activations, the head's logits counted apart) or the end of a backward
  (the bf16 gradients, 2 B a parameter, freed only after backward when the accumulator adds
  them to its fp32 buffers). 1F1B holds pp - rank micro-batches on a rank (its warm-up
  forwards and one), at most the micro-batches of a step. Under tensor parallelism the
  column linears' gathered input is one persistent buffer, (N, C) bf16.
logits: the head's rank keeps N x V/tp logits of one micro-batch (mem_logit_bytes each).

What one layer keeps for backward, bytes per token of a micro-batch (b = 2, s = tp in
REDUCE_SCATTER mode, C hidden, I MLP width, H heads, K = kv heads x head dim):
  each of its two RMSNorms  its input and fp32 rstd (C b + 4) / s, and its output, which the
                            next column linear saves sharded (tp_recompute_allgather): C b / s
  attention                 without GQA the projection's output is made one contiguous
                            (q, k, v) tensor, kept whole because flash-attention saves q, a
                            view of it: (C + 2K) b / tp; k and v concatenated and made
                            contiguous again for the rotary, saved as flash's k and v:
                            2K b / tp; with GQA q, k and v are copied apart instead, and only
                            q of them is kept: C b / tp + 2K b / tp; flash's output
                            (o_proj's input) C b / tp and fp32 log-sum-exp 4H / tp
  MLP                       gate|up (SiLU's and the product's inputs) 2I b / tp, SiLU's
                            output I b / tp, the product (down_proj's input) I b / tp
"""
from collections import namedtuple

from picotron.plan.memory_activations import in_flight, virtual_stages
from picotron.plan.memory_state import layer_params, table_params
from picotron.plan.stage_split import stage_split

Parts = namedtuple("Parts", "held rest logits")
BF16 = 2


def layer_bytes(config) -> float:
    """Bytes per token one nanotron Llama layer keeps for backward (module docstring)."""
    m, d = config.model, config.distributed
    tp, b = d.tp_size, BF16
    s = tp if d.sequence_parallel and tp > 1 else 1
    C, I, H = m.hidden_size, m.intermediate_size, m.num_attention_heads
    K = m.num_key_value_heads * (C // H)
    norms = 2 * (2 * C * b + 4) / s
    q = C if K != C else C + 2 * K          # MHA: q keeps the whole (q, k, v) tensor alive
    attention = (q + 2 * K + C) * b / tp + 4 * H / tp
    return norms + attention + 4 * I * b / tp


def rank_blocks(config, profile, pp_rank: int, split=None) -> tuple:
    """(layers, embedding, head) of this rank over its chunks, by the profile's split
    (`split`: stage_split's, when the caller has it)."""
    split, pp = split or stage_split(config, profile), config.distributed.pp_size
    mine = split[pp_rank::pp]
    return (sum(s[0] for s in mine), any(s[1] for s in mine), any(s[2] for s in mine))


def rank_parts(config, profile, pp_rank: int, blocks=None) -> Parts:
    """nanotron's memory on this pipeline rank (module docstring); `blocks`: its
    rank_blocks, when the caller has them."""
    m, d, t = config.model, config.distributed, config.training
    layers, embedding, head = blocks or rank_blocks(config, profile, pp_rank)
    table = table_params(m, d.tp_size)
    params = layers * layer_params(m, d.tp_size) + table * embedding + (
        table + m.hidden_size) * head
    if embedding and head and m.tie_word_embeddings:
        params -= table
    shard = d.dp_size * d.cp_size if d.zero_stage >= 1 else 1
    held = params * (2 + 4 + (2 if d.dp_size * d.cp_size > 1 else 0)) + 12 * params / shard
    tokens = t.micro_batch_size * t.seq_length // d.cp_size
    activations = layers * tokens * layer_bytes(config) / virtual_stages(config)
    others = (in_flight(config, pp_rank) - 1) * activations
    gathered = tokens * m.hidden_size * BF16 if d.tp_size > 1 and (layers or head) else 0
    logits = tokens * -(-m.vocab_size // d.tp_size) if head else 0
    forward_end = activations + logits * profile["mem_logit_bytes"]
    if forward_end >= BF16 * params:
        return Parts(held, others + activations + gathered, logits)
    return Parts(held, others + BF16 * params + gathered, 0)


def rank_need(parts: Parts, profile) -> float:
    """The bytes the profile predicts for a rank's Parts: its factors and extra applied."""
    return (profile["mem_held_factor"] * parts.held + profile["mem_act_factor"] * parts.rest
            + profile["mem_logit_bytes"] * parts.logits + profile["mem_extra_gib"] * 2 ** 30)


def busiest_need(config, profile) -> tuple:
    """(bytes, pipeline rank) of the rank that needs the most, the first of equals."""
    split = stage_split(config, profile)
    needs = [rank_need(rank_parts(config, profile, r, rank_blocks(config, profile, r, split)),
                       profile) for r in range(config.distributed.pp_size)]
    need = max(needs)
    return need, needs.index(need)
