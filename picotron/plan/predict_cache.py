"""The pieces of step_time.predict that a search shares between layouts, and their keys.

A search predicts thousands of layouts of one model on one profile; most pieces of a
prediction read only a few of the layout's knobs (a layer's compute: tp, cp, micro-batch,
recomputation, FP8; the pipeline's simulation: its schedule and durations), so predict takes
a cache, a dict kept for one search, and looks each piece up under the values it reads.
The keys name those values; tests/test_plan_search_speed.py holds a search's predictions
with the cache to the ones without it.
"""
import numpy as np

from picotron.plan.memory_activations import activation_rows, virtual_stages
from picotron.plan.memory_plan import estimate, has_auto
from picotron.plan.memory_state import rank_params, state_rows


def layout_key(config) -> tuple:
    """What a search varies between layouts: the knobs, and the options resolve_auto derives
    from them. A predict cache holds for configs that differ in these values only."""
    d, t, m = config.distributed, config.training, config.model
    return (d.dp_size, d.tp_size, d.pp_size, d.cp_size, d.cp_mode, d.zero_stage,
            t.micro_batch_size, t.gradient_accumulation_steps, t.activation_checkpointing,
            t.fp8, d.pp_engine, d.pp_virtual_stages, m.kernels, t.fused_loss, t.cuda_graphs)


def compute_key(config) -> tuple:
    """What compute_time's layer and ends read of layout_key: tp, cp, micro-batch,
    recomputation, FP8, CUDA graphs."""
    d, t = config.distributed, config.training
    return (d.tp_size, d.cp_size, t.micro_batch_size, t.activation_checkpointing, t.fp8,
            t.cuda_graphs)


def cached(cache, key, compute, *args):
    """compute(*args), looked up in `cache` under `key` (None: no cache)."""
    if cache is None:
        return compute(*args)
    value = cache.get(key, cache)
    if value is cache:
        value = cache[key] = compute(*args)
    return value


def _bytes_by_when(rows) -> dict:
    out = {}
    for row in rows:
        out.setdefault(row.when, []).append(row.bytes)
    return out


def _total(first: dict, second: dict, when: str):
    """sum(bytes of `when` over first's rows, then second's), summed in that order."""
    a, b = first.get(when), second.get(when)
    if not b:
        return sum(a) if a else 0
    total = sum(a) if a else 0
    for x in b:
        total += x
    return total


def _rank_parts(rows_of, pp: int, own: tuple):
    """Each rank's rows as {when: [bytes]}, and, when every rank's rows fall in `own` (the
    moments this part alone fills), {when: numpy array of each rank's sum}."""
    parts = [_bytes_by_when(rows_of(r)) for r in range(pp)]
    if any(set(p) - set(own) - {"host"} for p in parts):
        return parts, None
    return parts, {w: np.array([float(sum(p.get(w, ()))) for p in parts]) for w in own}


def _state_rows(config, params, cache):
    """state_rows, which reads the rank only through its Params: the middle ranks' once."""
    k = layout_key(config)
    return cached(cache, ("state rows", params) + k[:4] + k[5:6] + k[7:8] + k[9:10],
                  state_rows, config, params)


def cached_memory(config, cache) -> tuple:
    """(held bytes, device bytes) of memory_plan.estimate(config), the sums of its
    rank_estimate in its order (the state rows, then the activation rows), each part's rows
    of every rank cached by the knobs they read (memory_state.py, memory_activations.py)."""
    if has_auto(config):
        e = estimate(config)
        return sum(r.bytes for r in e.rows if r.when == "held"), e.device_bytes
    k, v, pp = layout_key(config), virtual_stages(config), config.distributed.pp_size
    state, state_sums = cached(
        cache, ("state", v) + k[:4] + k[5:6] + k[7:8] + k[9:10], _rank_parts,
        lambda r: _state_rows(config, cached(
            cache, ("rank params", v) + k[:4],
            lambda: [rank_params(config, i) for i in range(pp)])[r], cache), pp,
        ("held", "step"))
    act, act_sums = cached(cache, ("act", v) + k[1:4] + k[6:9] + k[10:11] + k[12:14],
                           _rank_parts, lambda r: activation_rows(config, r), pp, ("forward",))
    graphs = config.training.cuda_graphs is True
    if state_sums is not None and act_sums is not None:     # the parts' moments apart
        held, forward, step = state_sums["held"], act_sums["forward"], state_sums["step"]
        device = held + forward + step if graphs else held + np.maximum(forward, step)
        best = int(np.argmax(device))                       # the first of the largest
        return float(held[best]), float(device[best])
    best = None
    for r in range(pp):
        held, forward, step = (_total(state[r], act[r], w) for w in ("held", "forward", "step"))
        device = held + forward + step if graphs else held + max(forward, step)
        if best is None or device > best[1]:
            best = (held, device)
    return best
