"""The memory a config needs on each rank, estimated from its sizes before anything is
allocated; the refusal of a config that cannot fit and the warning for one that fits with
little to spare (`check_memory`, called by train.py's set-up), each naming the changes that
would fit (memory_advice.py); and what a run that ran out of memory anyway says
(`out_of_memory_message`, said by the watchdog). The rows' formulas live in memory_state.py
(weights, gradients, AdamW state) and memory_activations.py (what backward keeps).

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
not the allocator's fragmentation or the kernels' workspaces, and a GPU's memory is counted
less what the CUDA context holds (GPU_RESERVED); tests/test_memory_plan.py measures its
accuracy on CPU and bench/memory_plan_check.py on a GPU.
"""
import copy
import os
import re
import sys
from collections import namedtuple

import torch

from picotron.config import resolve_auto
from picotron.config.checks import layout_errors
from picotron.config.features import fp8_auto_choice
from picotron.errors import ConfigError
from picotron.plan.memory_activations import Row, activation_rows
from picotron.plan.memory_advice import describe_fixes, fixes
from picotron.plan.memory_state import GiB, rank_params, state_rows

Estimate = namedtuple("Estimate", "rows device_bytes host_bytes pp_rank rule")
# The estimate counts tensors, and has never measured above the peak: on CPU 1-5% below the
# resident set, on an H200 0-8% below the allocator's reserved peak (bench/NOTES.md, "Memory").
# So a config whose estimate exceeds the memory is refused; one that fits with less than
# MARGIN to spare runs, with a warning; the changes named as fixes leave MARGIN.
MEASURED_LOW = 0.08
MARGIN = 0.10
# What a CUDA process holds beside PyTorch's allocator (the context, cuBLAS and cuDNN
# workspaces, loaded kernels), out of the GPU's total: measured at an out-of-memory on an H200
# (torch 2.11, CUDA 13), 139.57 GiB in use against 136.38 GiB reserved by PyTorch.
GPU_RESERVED = int(3.2 * GiB)


def rank_estimate(config, pp_rank: int) -> Estimate:
    m = config.model
    rows = state_rows(config, rank_params(config, pp_rank)) + activation_rows(config, pp_rank)
    widest_full = max(m.vocab_size, m.intermediate_size) * m.hidden_size
    rows.append(Row("weights drawn at build time", widest_full * 4, "host",
                    f"the largest full parameter in fp32, {widest_full:,} x 4 B"))

    def total(when):
        return sum(r.bytes for r in rows if r.when == when)
    graphs = config.training.cuda_graphs is True
    rule = "held + forward + step: CUDA graphs" if graphs else "held + max(forward, step)"
    return Estimate(rows, device_bytes(total("held"), total("forward"), total("step"), graphs),
                    total("host"), pp_rank, rule)


def device_bytes(held, forward, step, graphs: bool):
    """A rank's peak on the device from its bytes held all step, at the forward's end and at
    the step's end: held + max(forward, step); under CUDA graphs the layers' activations live
    in the graphs' private pool, whose blocks the eager work at the step's end (gradient
    buffers, AdamW) cannot reuse, so both are held."""
    return held + forward + step if graphs else held + max(forward, step)


def estimate(config) -> Estimate:
    """The estimate of the pipeline rank that needs the most device memory. "auto" options
    are counted as what they resolve to (config.resolve_auto), on a copy; a config with none
    left (a search's, resolved) is read as it is."""
    if has_auto(config):
        config = copy.deepcopy(config)
        resolve_auto(config)
    return max((rank_estimate(config, r) for r in range(config.distributed.pp_size)),
               key=lambda e: e.device_bytes)


def has_auto(config) -> bool:
    """Whether any option resolve_auto resolves is still "auto"."""
    m, t = config.model, config.training
    return "auto" in (m.kernels, t.fused_loss, t.activation_checkpointing, t.fp8) or (
        t.cuda_graphs == "auto")


def describe(e: Estimate) -> str:
    """The rows as a table: GiB, when, name, formula."""
    lines = [f"{r.bytes / GiB:10.3f} GiB  {r.when:<8} {r.name}: {r.formula}" for r in e.rows]
    lines.append(f"{e.device_bytes / GiB:10.3f} GiB  per device ({e.rule}), "
                 f"pipeline rank {e.pp_rank}; host {e.host_bytes / GiB:.3f} GiB")
    return "\n".join(lines)


def memory_errors(config, device_memory, host_memory, ranks_per_host: int = 1) -> str:
    """"" when the estimate fits in `device_memory` and `host_memory` (bytes), else the
    refusal: the estimate, its biggest rows, and the changes that fit with MARGIN to spare
    (memory_advice.py). device_memory None: the device is the host (use_cpu); the host is
    shared by `ranks_per_host` ranks."""
    e, sharing = estimate(config), ranks_per_device(config)
    short = _shortfall(e, device_memory, host_memory, ranks_per_host, 0.0, sharing)
    if short is None:
        return ""
    need, has, on_device = short
    where = (f"on the GPU ({sharing} ranks share it, {e.device_bytes / GiB:.1f} GiB each)"
             if on_device and sharing > 1 else "per GPU" if on_device else
             f"on this host ({ranks_per_host} rank{'s' if ranks_per_host > 1 else ''})")
    biggest = ", ".join(f"{r.name} {r.bytes / GiB:.1f} GiB"
                        for r in sorted(e.rows, key=lambda r: -r.bytes)[:3])
    return (f"this config needs an estimated {need / GiB:.1f} GiB {where} but "
            f"{'the GPU' if on_device else 'the host'} has {has / GiB:.1f} GiB{_usable(on_device)}"
            f"; pipeline rank {e.pp_rank}, whose estimates have measured up to "
            f"{MEASURED_LOW:.0%} below the peak; biggest parts: {biggest}; these would fit with "
            f"{MARGIN:.0%} to spare: {_fixes(config, device_memory, host_memory, ranks_per_host)}"
            f"; `python -m picotron.plan.memory_plan CONFIG` prints every row")


def memory_warning(config, device_memory, host_memory, ranks_per_host: int = 1) -> str:
    """"" unless the estimate fits but leaves less than MARGIN of the memory to spare: then a
    warning that the run may run out of memory, with the changes that would leave it."""
    sharing = ranks_per_device(config)
    short = _shortfall(estimate(config), device_memory, host_memory, ranks_per_host, MARGIN,
                       sharing)
    if short is None:
        return ""
    need, has, on_device = short
    where = (f"on the GPU, {sharing} ranks" if on_device and sharing > 1 else
             "per GPU" if on_device else "on this host")
    return (f"warning: the memory estimate ({need / GiB:.1f} GiB {where}) leaves less than "
            f"{MARGIN:.0%} of the {has / GiB:.1f} GiB{_usable(on_device)} to spare, and "
            f"estimates have measured up to {MEASURED_LOW:.0%} below the peak: this run may "
            f"run out of memory. These would leave {MARGIN:.0%}: "
            f"{_fixes(config, device_memory, host_memory, ranks_per_host)}")


def out_of_memory_message(error, config, device) -> str:
    """What the watchdog says when the GPU ran out of memory anyway: torch's request, PyTorch's
    peak on this GPU, the estimate, and the changes whose estimates come MARGIN below both
    the memory and this config's own estimate, which proved short."""
    request = re.search(r"Tried to allocate [\d.]+ \w+", str(error))
    device_memory, host_memory, ranks = machine_memory(config, device)
    need = estimate(config).device_bytes
    return (f"the GPU ran out of memory{f' ({request[0]})' if request else ''}, at a peak of "
            f"{torch.cuda.max_memory_allocated(device) / GiB:.1f} GiB allocated and "
            f"{torch.cuda.max_memory_reserved(device) / GiB:.1f} GiB reserved by PyTorch, of "
            f"{device_memory / GiB:.1f} GiB{_usable(True)}; the plan estimated "
            f"{need / GiB:.1f} GiB per GPU (`python -m picotron.plan.memory_plan CONFIG` prints "
            f"every row); these would fit with {MARGIN:.0%} to spare: "
            f"{_fixes(config, min(device_memory, need), host_memory, ranks)}")


def ranks_per_device(config) -> int:
    """The ranks one GPU holds: all of them with distributed.share_gpu, else one."""
    d = config.distributed
    return config.world_size if d.share_gpu and not d.use_cpu else 1


def _needs(e: Estimate, device_memory, ranks_per_host: int, ranks_per_device: int) -> tuple:
    """(device need, host need) in bytes: on CPU runs the host holds both, for every rank; a
    shared GPU (distributed.share_gpu) holds every rank's device share."""
    if device_memory is None:
        return 0, ranks_per_host * (e.device_bytes + e.host_bytes)
    return ranks_per_device * e.device_bytes, ranks_per_host * e.host_bytes


def _shortfall(e: Estimate, device_memory, host_memory, ranks_per_host, margin: float,
               ranks_per_device: int = 1):
    """None when the estimate with `margin` to spare fits the device and the host, else
    (need, has, on_device) in bytes for the one it does not fit (the device first)."""
    dev, host = _needs(e, device_memory, ranks_per_host, ranks_per_device)
    if device_memory is not None and dev * (1 + margin) > device_memory:
        return dev, device_memory, True
    if host * (1 + margin) > host_memory:
        return host, host_memory, False
    return None


def _fixes(config, device_memory, host_memory, ranks_per_host) -> str:
    def fits(variant):
        return not layout_errors(variant) and _shortfall(
            estimate(variant), device_memory, host_memory, ranks_per_host, MARGIN,
            ranks_per_device(variant)) is None
    on_gpu = device_memory is not None
    return describe_fixes(fixes(config, fits, on_gpu), on_gpu)


def _usable(on_gpu: bool) -> str:
    """What "the GPU has N GiB" means: machine_memory counts a GPU's total less GPU_RESERVED."""
    if not on_gpu:
        return ""
    return f" usable (its total less {GPU_RESERVED / GiB:.1f} GiB outside PyTorch)"


def host_memory_bytes() -> int:
    """The host's physical memory (os.sysconf's pages)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_memory(config, device) -> tuple:
    """(device memory PyTorch can use, or None when the device is the host; host memory;
    ranks per host) in bytes, as a run of `config` on `device` has them here: the memory they
    have, not what is free now, so the same on every rank of a node."""
    if device.type == "cuda":      # a shared GPU (distributed.share_gpu): every rank here
        ranks = (config.world_size if ranks_per_device(config) > 1
                 else max(1, min(config.world_size, torch.cuda.device_count())))
        return (torch.cuda.mem_get_info(device)[1] - GPU_RESERVED, host_memory_bytes(),
                ranks)
    return None, host_memory_bytes(), config.world_size


def check_memory(config, device) -> None:
    """Raise ConfigError when the estimate says the config cannot fit in this rank's device or
    host memory, before anything is allocated. Every rank of a node refuses alike (the entry
    point then prints the message once and the other ranks leave quietly). Rank 0 warns of a
    config that fits with less than MARGIN to spare."""
    memory = machine_memory(config, device)
    message = memory_errors(config, *memory)
    if message:
        raise ConfigError(message)
    warning = memory_warning(config, *memory)
    if warning and int(os.environ.get("RANK", 0)) == 0:
        print(warning, file=sys.stderr, flush=True)


def main(argv=None):
    """`python -m picotron.plan.memory_plan CONFIG`: print a config's estimate, row by row, then
    whether it fits this machine, as train.py checks it: exit 1 when it does not (2: a config
    that does not load); "may not fit" with the fixes when it fits with little to spare."""
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
    warning = memory_warning(config, device_memory, host_memory, ranks)
    if warning:
        print(f"may not fit this machine: {warning.removeprefix('warning: ')}")
        return
    has = (f"the GPU's {device_memory / GiB:.1f} GiB{_usable(True)}" if device_memory is not None
           else f"the host's {host_memory / GiB:.1f} GiB, shared by {ranks} "
           f"rank{'s' if ranks > 1 else ''}")
    print(f"fits this machine: the estimate is within {has}, with {MARGIN:.0%} to spare, as "
          f"train.py checks it")


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
