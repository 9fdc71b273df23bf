"""The memory a config needs on each rank, estimated from its sizes before anything is
allocated, and the refusal of a config that cannot fit (`check_memory`, called by train.py's
set-up). The formulas of the activations live in memory_activations.py.

    estimate(config) -> Estimate(rows, device_bytes, host_bytes, pp_rank)

Each row is (name, bytes, when, formula) for the pipeline rank that needs the most (tp, cp and
dp ranks are alike). `when` says at which moment of a step the bytes are alive:
    held      the whole step: weights, AdamW state, gradient buffers under accumulation
    forward   at the activation peak, the end of forward and the start of backward:
              every in-flight micro-batch's saved activations, plus the loss (or one layer's
              backward, whichever is larger)
    step      the end of backward and the optimizer step: gradient buffers and temporaries
    host      host memory: CPU-offloaded AdamW state, the weights drawn at build time
device bytes = held + max(forward, step). The estimate counts tensors, not the CUDA context,
the allocator's fragmentation or the kernels' workspaces; tests/test_memory_plan.py measures
its accuracy on CPU and bench/memory_plan_check.py on a GPU.
"""
import copy
import os
from collections import namedtuple

import torch

from picotron.config import resolve_auto
from picotron.config_checks import layout_errors
from picotron.config_features import fp8_auto_choice
from picotron.errors import ConfigError
from picotron.memory_activations import BYTES, Row, activation_rows, rank_layer_spans

Estimate = namedtuple("Estimate", "rows device_bytes host_bytes pp_rank")
GiB = 2 ** 30
# Refuse only when even the estimate minus this fraction does not fit: a config that might
# fit is left to run (measured accuracy: the test and the bench above).
ACCURACY = 0.15


def layer_params(m, tp: int) -> int:
    """One decoder layer's parameters on a TP rank: q, o (C x C), k, v (K*D x C), gate, up,
    down (C x I) split over tp; the norms' gains (C each) replicated."""
    kv = m.num_key_value_heads * (m.hidden_size // m.num_attention_heads)
    matrices = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv
    matrices += 3 * m.hidden_size * m.intermediate_size
    return matrices // tp + (1 if m.parallel_residual else 2) * m.hidden_size


Params = namedtuple("Params", "total layer root largest")


def rank_params(config, pp_rank: int) -> Params:
    """This rank's parameters: in all, in one layer, outside the layers (the "root": the
    embedding on the first stage, the final norm and the head on the last; a tied head is the
    embedding itself with one stage, its own copy on the last of several), and its largest."""
    m, d = config.model, config.distributed
    layers = sum(n for _, n in rank_layer_spans(config, pp_rank))
    table = -(-m.vocab_size // d.tp_size) * m.hidden_size       # (V/tp, C), padded
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
    if t.fp8 != "none" and d.zero_stage < 3:    # speed/fp8_weights.py: W and W^T in FP8
        layers = (params.total - params.root) // params.layer
        norms = (1 if config.model.parallel_residual else 2) * config.model.hidden_size
        proj = layers * (params.layer - norms)
        rows.append(Row("FP8 weight copies", proj * 2, "held", f"{proj:,} x 2 B (W, W^T)"))
    if on_host:
        rows.append(Row("CPU-offloaded AdamW state", on_host * 20, "host",
                        f"{on_host:,.0f} x (12 B fp32 master + moments, 4 B gradient copy, "
                        f"4 B AdamW temporary)"))
    return rows


def rank_estimate(config, pp_rank: int) -> Estimate:
    m = config.model
    rows = state_rows(config, rank_params(config, pp_rank)) + activation_rows(config, pp_rank)
    widest_full = max(m.vocab_size, m.intermediate_size) * m.hidden_size
    rows.append(Row("weights drawn at build time", widest_full * 4, "host",
                    f"the largest full parameter in fp32, {widest_full:,} x 4 B"))

    def total(when):
        return sum(r.bytes for r in rows if r.when == when)
    device = total("held") + max(total("forward"), total("step"))
    return Estimate(rows, device, total("host"), pp_rank)


def estimate(config) -> Estimate:
    """The estimate of the pipeline rank that needs the most device memory. "auto" options
    are counted as what they resolve to (config.resolve_auto), on a copy."""
    config = copy.deepcopy(config)
    resolve_auto(config)
    return max((rank_estimate(config, r) for r in range(config.distributed.pp_size)),
               key=lambda e: e.device_bytes)


def describe(e: Estimate) -> str:
    """The rows as a table: GiB, when, name, formula."""
    lines = [f"{r.bytes / GiB:10.3f} GiB  {r.when:<8} {r.name}: {r.formula}" for r in e.rows]
    lines.append(f"{e.device_bytes / GiB:10.3f} GiB  per device (held + max(forward, step)), "
                 f"pipeline rank {e.pp_rank}; host {e.host_bytes / GiB:.3f} GiB")
    return "\n".join(lines)


def _changed(config, changes: dict):
    """A copy of config with {"section.key": value} applied."""
    variant = copy.deepcopy(config)
    for name, value in changes.items():
        section, key = name.split(".")
        setattr(getattr(variant, section), key, value)
    return variant


def _options(config) -> list:
    """{"section.key": value} changes, each lowering the memory per device, to try."""
    d, t = config.distributed, config.training
    more_tp = {"distributed.tp_size": 2 * d.tp_size}
    if t.fused_loss != "none":          # refused under tp: the vocab-parallel loss instead
        more_tp["training.fused_loss"] = "none"
    options = [more_tp, {"distributed.pp_size": 2 * d.pp_size}]
    if d.cp_size * d.dp_size > 1:
        options += [{"distributed.zero_stage": z} for z in (1, 2, 3) if z > d.zero_stage]
    if t.activation_checkpointing != "full":
        options.append({"training.activation_checkpointing": "full"})
    if t.dtype != "float32" and t.master_weights:
        options.append({"training.master_weights": False})
    return options


def _smaller_micro_batch(config, fits):
    """The largest micro-batch below the config's that fits, as changes that keep the global
    batch (more micro-batches of fewer sequences), or None."""
    t = config.training
    mbs = t.micro_batch_size // 2
    while mbs >= 1:
        factor = -(-t.micro_batch_size // mbs)
        changes = {"training.micro_batch_size": mbs,
                   "training.gradient_accumulation_steps": t.gradient_accumulation_steps * factor}
        if fits(_changed(config, changes)):
            return changes
        mbs //= 2
    return None


def memory_errors(config, device_memory, host_memory, ranks_per_host: int = 1) -> str:
    """"" when the estimate fits in `device_memory` and `host_memory` (bytes), else the
    refusal: the estimate, its biggest rows, and which of a few changes the estimate says
    would fit. device_memory None: the device is the host (use_cpu); the host is shared by
    `ranks_per_host` ranks."""
    def needs(e):                       # (device need, host need) in bytes
        if device_memory is None:
            return 0, ranks_per_host * (e.device_bytes + e.host_bytes)
        return e.device_bytes, ranks_per_host * e.host_bytes

    def fits(variant, slack=0.0):
        if layout_errors(variant):
            return False
        dev, host = needs(estimate(variant))
        return ((device_memory is None or dev * (1 - slack) <= device_memory)
                and host * (1 - slack) <= host_memory)
    if fits(config, ACCURACY):
        return ""
    e = estimate(config)
    dev, host = needs(e)
    on_device = device_memory is not None and dev * (1 - ACCURACY) > device_memory
    need, has = (dev, device_memory) if on_device else (host, host_memory)
    where = ("per GPU" if on_device else
             f"on this host ({ranks_per_host} rank{'s' if ranks_per_host > 1 else ''})")
    biggest = ", ".join(f"{r.name} {r.bytes / GiB:.1f} GiB"
                        for r in sorted(e.rows, key=lambda r: -r.bytes)[:3])
    fitting = [changes for changes in _options(config) if fits(_changed(config, changes))]
    for base in ({}, {"training.activation_checkpointing": "full"}):
        smaller = _smaller_micro_batch(_changed(config, base), fits)
        if smaller and (not base or not fitting):
            fitting.append({**base, **smaller})
            break
    advice = ("; ".join(", ".join(f"{k}={v}" for k, v in c.items()) for c in fitting)
              or "none of: twice the tp or pp, ZeRO, full recomputation, a smaller micro-batch")
    if any("distributed.tp_size" in c or "distributed.pp_size" in c for c in fitting):
        advice += " (a larger tp or pp takes as many times the devices)"
    return (f"this config needs an estimated {need / GiB:.1f} GiB {where} but "
            f"{'the GPU' if on_device else 'the host'} has {has / GiB:.1f} GiB (pipeline "
            f"rank {e.pp_rank}; the estimate is accurate to ~{ACCURACY:.0%}); biggest parts: "
            f"{biggest}; the estimate says these would fit: {advice}; `python -m "
            f"picotron.memory_plan CONFIG` prints every row")


def host_memory_bytes() -> int:
    """The host's physical memory (os.sysconf's pages)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(config, device) -> None:
    """Raise ConfigError when the estimate says the config cannot fit in this rank's device or
    host memory, before anything is allocated. It compares with the memory they have, not what
    is free now: the same on every rank of a node, so every rank refuses alike (the entry point
    then prints the message once and the other ranks leave quietly)."""
    if device.type == "cuda":
        device_memory = torch.cuda.mem_get_info(device)[1]
        ranks = max(1, min(config.world_size, torch.cuda.device_count()))
    else:
        device_memory, ranks = None, config.world_size
    message = memory_errors(config, device_memory, host_memory_bytes(), ranks)
    if message:
        raise ConfigError(message)


def main(argv=None):
    """`python -m picotron.memory_plan CONFIG`: print a config's estimate, row by row."""
    import argparse
    from picotron.config import load_config
    p = argparse.ArgumentParser(description="Print the memory estimate of a config.json.")
    p.add_argument("config", help="path to a config.json (create_config.py writes one)")
    config = load_config(p.parse_args(argv).config)
    e = estimate(config)
    print(describe(e))
    note = fp8_auto_note(config, e)
    if note:
        print(note)


def fp8_auto_note(config, e: Estimate):
    """Where training.fp8=auto resolved to none only because this machine (a login node, say)
    has no GPU with FP8 tensor cores: what the estimate grows by on one that has them."""
    if (config.distributed.use_cpu
            or getattr(config, "auto_resolved", {}).get("training.fp8") != "none"):
        return None
    chosen = fp8_auto_choice(config, tensor_cores=True)
    if chosen == "none":
        return None
    there = copy.deepcopy(config)
    there.training.fp8 = chosen
    more = estimate(there).device_bytes - e.device_bytes
    return (f"training.fp8=auto is counted as 'none' here: this machine has no GPU with FP8 "
            f"tensor cores. On one that has them (H100, H200) it picks '{chosen}' for this "
            f"model: {more / GiB:.3f} GiB more per device (FP8 weight copies).")


if __name__ == "__main__":
    main()
