"""The memory a config needs on each rank, estimated from its sizes before anything is
allocated, and the refusal of a config that cannot fit (`check_memory`, called by train.py's
set-up). The rows' formulas live in memory_state.py (weights, gradients, AdamW state) and
memory_activations.py (what backward keeps).

    estimate(config) -> Estimate(rows, device_bytes, host_bytes, pp_rank, rule)

Each row is (name, bytes, when, formula) for the pipeline rank that needs the most (tp, cp and
dp ranks are alike). `when` says at which moment of a step the bytes are alive:
    held      the whole step: weights, AdamW state, gradient buffers under accumulation
    forward   at the activation peak, the end of forward and the start of backward:
              every in-flight micro-batch's saved activations, plus the loss (or one layer's
              backward, whichever is larger)
    step      the end of backward and the optimizer step: gradient buffers and temporaries
    host      host memory: CPU-offloaded AdamW state, the weights drawn at build time
device bytes = held + max(forward, step), or held + forward + step under CUDA graphs (the
graphs' pool keeps the activations' blocks from the step's end). The estimate counts tensors,
not the CUDA context, the allocator's fragmentation or the kernels' workspaces;
tests/test_memory_plan.py measures its accuracy on CPU and bench/memory_plan_check.py on a GPU.
"""
import copy
import os
import sys
from collections import namedtuple

import torch

from picotron.config import resolve_auto
from picotron.config.checks import layout_errors
from picotron.config.features import fp8_auto_choice
from picotron.errors import ConfigError
from picotron.run.memory_activations import Row, activation_rows
from picotron.run.memory_state import GiB, rank_params, state_rows

Estimate = namedtuple("Estimate", "rows device_bytes host_bytes pp_rank rule")
# Refuse only when even the estimate minus this fraction does not fit: a config that might
# fit is left to run (measured accuracy: the test and the bench above).
ACCURACY = 0.15


def rank_estimate(config, pp_rank: int) -> Estimate:
    m = config.model
    rows = state_rows(config, rank_params(config, pp_rank)) + activation_rows(config, pp_rank)
    widest_full = max(m.vocab_size, m.intermediate_size) * m.hidden_size
    rows.append(Row("weights drawn at build time", widest_full * 4, "host",
                    f"the largest full parameter in fp32, {widest_full:,} x 4 B"))

    def total(when):
        return sum(r.bytes for r in rows if r.when == when)
    # Under CUDA graphs the layers' activations live in the graphs' private pool, whose blocks
    # the eager work at the step's end (gradient buffers, AdamW) cannot reuse: both are held.
    if config.training.cuda_graphs is True:
        device = total("held") + total("forward") + total("step")
        rule = "held + forward + step: CUDA graphs"
    else:
        device = total("held") + max(total("forward"), total("step"))
        rule = "held + max(forward, step)"
    return Estimate(rows, device, total("host"), pp_rank, rule)


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
    lines.append(f"{e.device_bytes / GiB:10.3f} GiB  per device ({e.rule}), "
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


def _offloaded(config, fits):
    """The smallest share of the AdamW state stepped on the host (distributed.offload_optim_frac,
    in tenths), with full recomputation when that alone is not enough, that fits on the same
    devices, as changes, or None. The host is slower at AdamW than the GPU, so this is named
    only where nothing that keeps the step on the devices fits without more of them."""
    t = config.training
    for base in ({}, {"training.activation_checkpointing": "full"}):
        if base and t.activation_checkpointing == "full":
            break
        for tenths in range(1, 11):
            frac = tenths / 10
            changes = {**base, "distributed.offload_optim_frac": frac}
            if frac > config.distributed.offload_optim_frac and fits(_changed(config, changes)):
                return changes
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
    more_devices = ("distributed.tp_size", "distributed.pp_size")
    if device_memory is not None and all(any(k in c for k in more_devices) for c in fitting):
        offload = _offloaded(config, fits)      # the one fix left on this many GPUs
        fitting += [offload] if offload else []
    tried = ("twice the tp or pp, ZeRO, full recomputation, a smaller micro-batch"
             + (", the AdamW state offloaded to the host" if device_memory is not None else ""))
    advice = ("; ".join(", ".join(f"{k}={v}" for k, v in c.items()) for c in fitting)
              or f"none of: {tried}")
    if any("distributed.tp_size" in c or "distributed.pp_size" in c for c in fitting):
        advice += " (a larger tp or pp takes as many times the devices)"
    return (f"this config needs an estimated {need / GiB:.1f} GiB {where} but "
            f"{'the GPU' if on_device else 'the host'} has {has / GiB:.1f} GiB (pipeline "
            f"rank {e.pp_rank}; the estimate is accurate to ~{ACCURACY:.0%}); biggest parts: "
            f"{biggest}; the estimate says these would fit: {advice}; `python -m "
            f"picotron.run.memory_plan CONFIG` prints every row")


def host_memory_bytes() -> int:
    """The host's physical memory (os.sysconf's pages)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_memory(config, device) -> tuple:
    """(device memory, or None when the device is the host; host memory; ranks per host) in
    bytes, as a run of `config` on `device` has them here. The memory they have, not what is
    free now: the same on every rank of a node."""
    if device.type == "cuda":
        ranks = max(1, min(config.world_size, torch.cuda.device_count()))
        return torch.cuda.mem_get_info(device)[1], host_memory_bytes(), ranks
    return None, host_memory_bytes(), config.world_size


def check_memory(config, device) -> None:
    """Raise ConfigError when the estimate says the config cannot fit in this rank's device or
    host memory, before anything is allocated. Every rank of a node refuses alike (the entry
    point then prints the message once and the other ranks leave quietly)."""
    message = memory_errors(config, *machine_memory(config, device))
    if message:
        raise ConfigError(message)


def main(argv=None):
    """`python -m picotron.run.memory_plan CONFIG`: print a config's estimate, row by row, then
    whether it fits this machine, as train.py checks it: exit 1 when it does not (2: a config
    that does not load)."""
    import argparse
    from picotron.config import load_config
    from picotron.config.overrides import parse_flags
    p = argparse.ArgumentParser(description="Print the memory estimate of a config.json, and "
                                "whether it fits this machine (exit 1 when it does not).",
                                allow_abbrev=False)
    p.add_argument("config", help="path to a config.json (create_config.py writes one)")
    try:
        config = load_config(parse_flags(p, argv).config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    e = estimate(config)
    print(describe(e))
    note = fp8_auto_note(config, e)
    if note:
        print(note)
    if not config.distributed.use_cpu and not torch.cuda.is_available():
        print("whether it fits is not checked: the config runs on GPUs and none is visible "
              "here; run this on a machine of the kind that trains")
        return
    device = torch.device("cpu" if config.distributed.use_cpu else "cuda")
    device_memory, host_memory, ranks = machine_memory(config, device)
    message = memory_errors(config, device_memory, host_memory, ranks)
    if message:
        print(f"error: does not fit this machine: {message}", file=sys.stderr)
        sys.exit(1)
    has = (f"the GPU's {device_memory / GiB:.1f} GiB" if device_memory is not None else
           f"the host's {host_memory / GiB:.1f} GiB, shared by {ranks} "
           f"rank{'s' if ranks > 1 else ''}")
    print(f"fits this machine: the estimate is within {has}, as train.py checks it")


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
