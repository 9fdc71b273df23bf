"""What to change when a config does not fit: a few changes, each lowering the memory per
device, tried on copies of the config and kept when the estimate says they fit.

    fixes(config, fits, on_gpu) -> [{"section.key": value, ...}, ...]
    describe_fixes(fixes, tried) -> "training.activation_checkpointing=full; ..."

`fits(variant) -> bool` is the caller's judgement (memory_plan.py: the estimate and a margin
within this machine's memory), so this file knows nothing of estimates. The changes, in order:
twice the tp or pp (more devices), ZeRO when dp x cp shards the state, full recomputation,
no fp32 master copy, full recomputation with ZeRO or without the master copy, then the largest
smaller micro-batch that keeps the global batch. Only
where every fix found needs more devices is the AdamW state offloaded to the host named: the
host is slower at AdamW than the GPU.
"""
import copy

MORE_DEVICES = ("distributed.tp_size", "distributed.pp_size")


def changed(config, changes: dict):
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
        if fits(changed(config, changes)):
            return changes
        mbs //= 2
    return None


def _offloaded(config, fits):
    """The smallest share of the AdamW state stepped on the host (distributed.offload_optim_frac,
    in tenths), with full recomputation when that alone is not enough, that fits on the same
    devices, as changes, or None."""
    t = config.training
    for base in ({}, {"training.activation_checkpointing": "full"}):
        if base and t.activation_checkpointing == "full":
            break
        for tenths in range(1, 11):
            frac = tenths / 10
            changes = {**base, "distributed.offload_optim_frac": frac}
            if frac > config.distributed.offload_optim_frac and fits(changed(config, changes)):
                return changes
    return None


def fixes(config, fits, on_gpu: bool) -> list:
    """The changes that `fits` accepts, each a {"section.key": value} dict, in the order
    above; offload (on GPUs) only when every other one needs more devices."""
    found = [changes for changes in _options(config) if fits(changed(config, changes))]
    full = {"training.activation_checkpointing": "full"}
    if config.training.activation_checkpointing != "full" and full not in found:
        for extra in _options(changed(config, full)):     # full recomputation and one more
            combined = {**full, **extra}
            if not any(k in extra for k in MORE_DEVICES) and fits(changed(config, combined)):
                found.append(combined)
    for base in ({}, full):
        smaller = _smaller_micro_batch(changed(config, base), fits)
        if smaller and (not base or not found):
            found.append({**base, **smaller})
            break
    if on_gpu and all(any(k in c for k in MORE_DEVICES) for c in found):
        offload = _offloaded(config, fits)      # the one fix left on this many GPUs
        found += [offload] if offload else []
    return found


def describe_fixes(found: list, on_gpu: bool) -> str:
    """The fixes as `key=value` lists separated by "; ", or what was tried when none fits."""
    if not found:
        return ("none of: twice the tp or pp, ZeRO, full recomputation, a smaller micro-batch"
                + (", the AdamW state offloaded to the host" if on_gpu else ""))
    text = "; ".join(", ".join(f"{k}={_as_flag(v)}" for k, v in c.items()) for c in found)
    if any(any(k in c for k in MORE_DEVICES) for c in found):
        text += " (a larger tp or pp takes as many times the devices)"
    return text


def _as_flag(value) -> str:
    """A value as `--set` reads it: JSON's true / false, not Python's True / False."""
    return str(value).lower() if isinstance(value, bool) else str(value)
