"""The pieces of step_time.predict that a search shares between layouts, and their keys.

A search predicts thousands of layouts of one model on one profile; most pieces of a
prediction read only a few of the layout's knobs (a layer's compute: tp, cp, micro-batch,
recomputation, FP8; the pipeline's simulation: its schedule and durations), so predict takes
a cache, a dict kept for one search, and looks each piece up under the values it reads.
The keys name those values; tests/test_plan_search_speed.py holds a search's predictions
with the cache to the ones without it.
"""
from picotron.plan.memory_activations import activation_rows, virtual_stages
from picotron.plan.memory_plan import device_bytes, has_auto
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


def optimizer_key(config, params) -> tuple:
    """What compute_time.optimizer_s reads of a rank holding `params` parameters: its ZeRO
    shard (dp, cp, zero) and the traffic's "step" terms, which FP8 adds to (CUDA graphs add
    a term of another scope; counted too, as compute_key counts it)."""
    d, t = config.distributed, config.training
    return ("optimizer", params, d.dp_size, d.cp_size, d.zero_stage, t.fp8, t.cuda_graphs)


def cached(cache, key, compute, *args):
    """compute(*args), looked up in `cache` under `key` (None: no cache)."""
    if cache is None:
        return compute(*args)
    value = cache.get(key, cache)
    if value is cache:
        value = cache[key] = compute(*args)
    return value


def _sums(rows, moments: tuple):
    """{when: sum of the rows' bytes at that moment, in their order} of one rank's rows, or
    None when a row falls outside `moments` (the ones its part alone fills) and "host"."""
    sums = dict.fromkeys(moments, 0)
    for row in rows:
        if row.when in sums:
            sums[row.when] += row.bytes
        elif row.when != "host":
            return None
    return {when: float(total) for when, total in sums.items()}


def state_key(k: tuple) -> tuple:
    """What state_rows reads of layout_key `k` beside the rank's Params: the grid, ZeRO, FP8,
    and whether there is accumulation (grad_acc > 1: the gradients' dtype and lifetime)."""
    return k[:4] + k[5:6] + (k[7] > 1,) + k[9:10]


def _state_sums(config, v, cache):
    """Each rank's state rows summed by moment (held, step), or None (_sums); state_rows reads
    the rank only through its Params (rank_params), so alike ranks are summed once."""
    k = layout_key(config)
    ranks = cached(cache, ("rank params", v) + k[:4],
                   lambda: [rank_params(config, i) for i in range(config.distributed.pp_size)])
    reads, of_params = state_key(k), {}
    for params in ranks:            # the middle ranks' Params are one: looked up once
        if params not in of_params:
            of_params[params] = cached(cache, ("state sums", params) + reads, _rank_state_sums,
                                       config, params)
    sums = [of_params[params] for params in ranks]
    return None if None in sums else sums


def _rank_state_sums(config, params):
    """_sums of one rank's state rows at held and step."""
    return _sums(state_rows(config, params), ("held", "step"))


def _activation_sums(config, cache):
    """Each rank's activation rows summed at "forward", or None (_sums). What activation_rows
    computes alike (`shared`) is kept for the configs that differ only in grad_acc and the
    engine, which set no more than each rank's micro-batches in flight (in_flight): with it,
    each list of rows' sums by the list's id (alike ranks share one list; the dict keeps it)."""
    k = layout_key(config)
    shared = cached(cache, ("act shared", virtual_stages(config)) + k[1:4] + (k[6], k[8])
                    + k[12:14], dict)
    sums = []
    for r in range(config.distributed.pp_size):
        rows = activation_rows(config, r, shared, described=False)
        key = ("forward sums", id(rows))
        if key not in shared:
            shared[key] = _sums(rows, ("forward",))
        sums.append(shared[key])
    return None if None in sums else sums


def cached_memory(config, cache) -> list:
    """trainer_memory.rank_sums: [(held bytes, device bytes)] of the ranks of
    memory_plan.estimate(config) that can be the busiest, the last pipeline rank's last, the
    sums of each rank_estimate in its order (the state rows, then the activation rows), each
    part's sums of every rank cached by the knobs they read (memory_state.py,
    memory_activations.py); the whole is not kept: its key, memory_key, holds nearly every
    knob (the caller keeps its fit under it). None for a config with "auto" (the caller's own
    estimate)."""
    if has_auto(config):
        return None                 # the caller's own estimate (trainer_memory.memory_fit)
    k, v = layout_key(config), virtual_stages(config)
    state = cached(cache, ("state", v) + state_key(k), _state_sums, config, v, cache)
    act = cached(cache, ("act", v) + k[1:4] + k[6:9] + k[10:11] + k[12:14], _activation_sums,
                 config, cache)
    if state is None or act is None:        # a row at another part's moment: sum them all
        return _summed_memory(config)
    graphs, sums, alike = config.training.cuda_graphs is True, [], None
    last = len(state) - 1
    for r, (s, a) in enumerate(zip(state, act)):
        if alike is not None and s is alike[0] and a is alike[1] and r < last:
            continue            # the rank before's sums (the middle ranks'): no larger
        alike = s, a
        held, forward, step = s["held"], a["forward"], s["step"]
        sums.append((held, device_bytes(held, forward, step, graphs)))
    return sums


def memory_key(config) -> tuple:
    """What the memory's rows read of layout_key: all but cp_mode (the parts' keys in
    cached_memory); "auto" options (has_auto) as given, which the search's base config
    resolves alike."""
    k = layout_key(config)
    return ("memory",) + k[:4] + k[5:]


def _summed_memory(config) -> list:
    """cached_memory of rows that do not keep to their parts' moments: each rank's totals."""
    sums = []
    for r in range(config.distributed.pp_size):
        rows = state_rows(config, rank_params(config, r)) + activation_rows(config, r)
        held, forward, step = (sum(row.bytes for row in rows if row.when == when)
                               for when in ("held", "forward", "step"))
        sums.append((held, device_bytes(held, forward, step,
                                        config.training.cuda_graphs is True)))
    return sums
