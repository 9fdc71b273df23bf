"""The memory of a rank's parameters: how many it holds (per layer, outside the layers, the
largest), and the rows of the weights, gradient buffers, AdamW state and optimizer temporaries
they need under the config's dtype, ZeRO stage, offload and gradient reduction
(memory_plan.py adds the activations of memory_activations.py and totals the rows).
"""
from collections import namedtuple

from picotron.plan.memory_activations import BYTES, Row, rank_layer_spans

GiB = 2 ** 30


def layer_params(m, tp: int) -> int:
    """One decoder layer's parameters on a TP rank: q, o (C x C), k, v (K*D x C), gate, up,
    down (C x I) split over tp; the norms' gains (C each) replicated."""
    kv = m.num_key_value_heads * (m.hidden_size // m.num_attention_heads)
    matrices = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv
    matrices += 3 * m.hidden_size * m.intermediate_size
    return matrices // tp + (1 if m.parallel_residual else 2) * m.hidden_size


def table_params(m, tp: int) -> int:
    """The (V/tp, C) embedding table's parameters on a TP rank, the vocabulary padded to tp."""
    return -(-m.vocab_size // tp) * m.hidden_size


Params = namedtuple("Params", "total layer root largest")


def rank_params(config, pp_rank: int) -> Params:
    """This rank's parameters: in all, in one layer, outside the layers (the "root": the
    embedding on the first stage, the final norm and the head on the last; a tied head is the
    embedding itself with one stage, its own copy on the last of several), and its largest."""
    m, d = config.model, config.distributed
    layers = sum(n for _, n in rank_layer_spans(config, pp_rank))
    table = table_params(m, d.tp_size)
    first, last = pp_rank == 0, pp_rank == d.pp_size - 1
    root = table * first + (m.hidden_size + table) * last
    if first and last and m.tie_word_embeddings:
        root -= table
    widest = max(m.hidden_size, m.intermediate_size // d.tp_size) * m.hidden_size
    layer = layer_params(m, d.tp_size)
    return Params(layers * layer + root, layer, root, table if first or last else widest)


def state_rows(config, params: Params) -> list:
    """Weights, gradient buffers and AdamW state of this rank's parameters."""
    d, t = config.distributed, config.training
    b, numel = BYTES[t.dtype], params.total
    shards = d.cp_size * d.dp_size if d.zero_stage >= 1 else 1
    shard = numel / shards
    on_host = d.offload_optim_frac * shard             # buckets stepped on the CPU
    on_device = shard - on_host
    # data_parallel/buckets.py `gradient_dtype`: fp32 when anything is summed into the buffer
    # (micro-batches, cp*dp ranks in fp32), else the parameters' dtype (partial sums: tiny
    # buckets). A bf16 reduction of an fp32 (or fp16) buffer goes through a bf16 copy of it.
    ranks, bf16_wire = d.cp_size * d.dp_size, d.grad_reduce_dtype == "bfloat16"
    summed = t.gradient_accumulation_steps > 1 or (ranks > 1 and not bf16_wire)
    g = 4 if summed or (d.zero_stage == 3 and not bf16_wire) else b
    cast = ranks > 1 and bf16_wire and (g == 4 or t.dtype == "float16")
    grads_when = "held" if t.gradient_accumulation_steps > 1 else "step"
    master = 4 if t.dtype != "float32" and t.master_weights else 0
    moment = 4 if t.dtype == "float32" or t.master_weights else b     # the master's dtype
    adamw = Row("AdamW state", on_device * (master + 2 * moment), "held",
                f"(fp32 master {master} B + 2 moments x {moment} B) x {on_device:,.0f} "
                f"(parameters / {shards} ZeRO shards x {1 - d.offload_optim_frac:g} on device)")
    if d.zero_stage == 3:      # shards kept; a unit's whole weights only while it is in use
        keep = getattr(d, "zero3_keep_params", False)
        gathered = numel if keep else min(numel, params.root + 2 * params.layer)
        rows = [Row("weight shards", shard * b, "held", f"{shard:,.0f} x {b} B"),
                Row("gathered weights", gathered * b, "held",
                    "every layer (zero3_keep_params)" if keep else
                    "the embedding and head, the layer in use and the next one"), adamw,
                Row("gradient shards", shard * g, grads_when, f"{shard:,.0f} x {g} B"),
                Row("whole gradients in flight", params.layer * (2 * g + 2 * cast), "step",
                    f"two layers' gradients in {g} B (one reduce-scattering"
                    + (", with its 2 B bf16 copy)" if cast else ")"))]
    else:
        # allocated at a step's first gradient, freed after the step; under accumulation they
        # live through the forwards of the later micro-batches too
        rows = [Row("weights", numel * b, "held", f"{numel:,} parameters x {b} B"), adamw,
                Row("gradient buffers", numel * g, grads_when, f"{numel:,} x {g} B")]
        if d.zero_stage == 2 and shards > 1:
            rows.append(Row("ZeRO-2 gradient shard", shard * g, "step", f"{shard:,.0f} x {g} B"))
        if d.zero_stage == 1 and shards > 1 and not cast:   # reduce-scattered beside the buffer
            rows.append(Row("ZeRO-1 reduced shard", shard * g, "step", f"{shard:,.0f} x {g} B"))
        if cast:           # every bucket's bf16 copy (and ZeRO-1/2 shard) until the last wait
            wire = numel + (shard if d.zero_stage >= 1 and shards > 1 else 0)
            rows.append(Row("bf16 gradients on the wire", wire * 2, "step", f"{wire:,.0f} x 2 B"))
    # torch's foreach AdamW (the reference: on CPU, or without use_fused_adam) makes one
    # temporary of the moments' dtype (the second moment's sqrt), holds each gradient as a
    # copy in the master's dtype unless it already is one, and the gradient norm squares one
    # bucket at a time in fp32; the Triton AdamW (the GPU default) updates in place
    grad_copy = 0 if g == 4 and moment == 4 else moment
    bucket = min(numel, d.bucket_size_mb * 2 ** 20 / 4) * 4
    reference = not t.use_fused_adam or d.use_cpu
    temp = on_device * (moment + grad_copy) + bucket if reference else 0
    rows.append(Row("optimizer or gradient temporaries, the larger",
                    max(temp, params.largest * b), "step",
                    f"max(AdamW temporaries {temp / GiB:.2f} GiB, the largest parameter's "
                    f"gradient before its bucket takes it {params.largest:,} x {b} B)"))
    if t.fp8 != "none" and d.zero_stage < 3:    # speed/fp8/weights.py: W and W^T in FP8
        layers = (params.total - params.root) // params.layer
        norms = (1 if config.model.parallel_residual else 2) * config.model.hidden_size
        proj = layers * (params.layer - norms)
        rows.append(Row("FP8 weight copies", proj * 2, "held", f"{proj:,} x 2 B (W, W^T)"))
    if on_host:
        rows.append(Row("CPU-offloaded AdamW state", on_host * 20, "host",
                        f"{on_host:,.0f} x (12 B fp32 master + moments, 8 B the gradient's "
                        f"copies and AdamW's temporaries, or the GPU's transfer buffers)"))
    return rows
