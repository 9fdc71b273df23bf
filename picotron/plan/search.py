"""Every layout of N GPUs that the config accepts, each scored by the step-time model, ranked by
predicted tokens per second per GPU; the refused ones counted by the config's reason.

A layout is a dict of the knobs below (LAYOUT_KEYS: short name -> config key). The search
varies every knob the user did not fix, over every value the config has for it:
    dp, tp, pp, cp   the grid, dp*tp*pp*cp = N (each a divisor of N)
    cp_mode          ring | ulysses, when cp > 1
    zero             ZeRO stage 0-3
    mbs, grad_acc    micro-batch and accumulation, dp*mbs*grad_acc sequences = the global batch
    recompute        training.activation_checkpointing: none | full | selective
    pp_engine        afab | 1f1b | interleaved, when pp > 1
    interleave       pp_virtual_stages, with interleaved (every v that the config could accept)
    fp8              none, and each FP8 recipe the hardware profile models
A knob that means nothing for a layout (cp_mode at cp 1, the engine at pp 1, the interleave of
a non-interleaved engine) keeps the base config's value: the config accepts every value of it
there, and they are one layout.

Each candidate is judged by the config's own checks, the body of config_from_dict without its
type checks (every knob is typed by construction): the knobs' ranges, then layout_errors on
the config resolved. Two shortcuts keep a search of 512 GPUs quick, both the config's rules:
the interleaved engine is tried only with v dividing layers / pp and grad_acc a multiple of pp
(pipeline_errors refuses every other), and a grid (dp, tp, pp, cp, cp_mode) that the config
refuses for one reason at both ends of its layouts (grid_verdict) has all of them counted as
refused for it, unjudged. tests/test_plan_search.py holds the accepted set to a brute-force
filter through config_from_dict itself. Each accepted layout is then scored by
step_time.predict; one that does not fit the GPU's memory is refused with the model's note,
from its memory alone (step_time.cached_fit: the same estimate), before its step is timed.
Where the machine has a second core, a large search shares its grids with a forked process
(share_work.py), each pp's grids in one of the two: the same result, in the same order.
"""
import gc
import time
from collections import Counter
from dataclasses import dataclass, field

from picotron.config import Config, ConfigError, config_from_dict
from picotron.config.overrides import apply_overrides
from picotron.config.presets import resolve_model
from picotron.config.checks import CHECKPOINTING, CP_MODES, PP_ENGINES
from picotron.plan.judge import LAYOUT_KEYS, grid_verdict, judge, knobs_in_range
from picotron.plan.layouts import node_refusal
from picotron.plan.report import reason, widen
from picotron.plan.share_work import default_processes, share_work

RECOMPUTE = tuple(c for c in CHECKPOINTING if c != "auto")
# the layouts from which a search shares its grids with a second process by default
# (share_work.py): below, a search takes about a second alone, and on a loaded machine the
# fork, the pickles and the wait for a core cost about what the second core saves
# (bench/NOTES.md, "Planner search speed")
SHARED_FROM = 20_000
ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class Scored:
    layout: dict            # short name -> value, every knob of LAYOUT_KEYS
    prediction: object      # step_time.Prediction


@dataclass
class SearchResult:
    ranked: list            # Scored that fit, fastest (tok/s/GPU) first
    refused: Counter        # reason (numbers masked as N) -> layouts refused for it
    examples: dict          # reason -> the first full message given for it
    considered: int         # candidates judged
    seconds: float = 0.0
    refused_layouts: list = field(default_factory=list)   # (layout, message), when kept
    processes: int = 1      # that judged and scored them (share_work.py)
    # reason -> [least, greatest] of the first decimal number in its messages: a memory
    # refusal's estimate differs layout by layout (the rest is the first message's)
    spans: dict = field(default_factory=dict)
    base: object = None     # the Config each layout was judged as (judge.with_layout)


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def fp8_options(profile) -> tuple:
    """'none', and where the profile's GPU has FP8 tensor cores (a peak_fp8_flops) the recipes
    its traits name as modelled ("fp8_recipes"), by default the one training.fp8="auto"
    picks: the model times every recipe's GEMMs alike, so others would be copies of it."""
    numbers, traits = getattr(profile, "numbers", {}), getattr(profile, "traits", {})
    if not numbers.get("peak_fp8_flops"):
        return ("none",)
    return ("none",) + tuple(traits.get("fp8_recipes", ("tensorwise_delayed",)))


def global_sequences(global_batch_tokens: int, seq_len: int) -> int:
    if global_batch_tokens < seq_len or global_batch_tokens % seq_len:
        raise ConfigError(f"--global_batch_tokens {global_batch_tokens} is not a whole number "
                          f"of sequences of --seq_len {seq_len}; give a multiple of it, e.g. "
                          f"{max(1, global_batch_tokens // seq_len) * seq_len}")
    return global_batch_tokens // seq_len


def grids(gpus: int, fixed: dict):
    """(dp, tp, pp, cp) with dp*tp*pp*cp = gpus, and the sizes in `fixed` as fixed."""
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // (tp * pp)):
                grid = {"dp": gpus // (tp * pp * cp), "tp": tp, "pp": pp, "cp": cp}
                if all(fixed.get(name, size) == size for name, size in grid.items()):
                    yield grid


def subtree(grid: dict, sequences: int, layers: int, fp8: tuple, fixed: dict, base: dict):
    """Every layout of one grid (dp, tp, pp, cp, cp_mode) to judge: the product of each other
    knob's values (a fixed knob: the given value only). `base` holds the value a knob keeps
    where it means nothing (see the docstring). The interleaved engine is tried only where the
    config's pipeline rule can accept it: grad_acc a multiple of pp, v dividing layers / pp."""
    def values(name, options):
        return (fixed[name],) if name in fixed else tuple(options)
    dp, pp = grid["dp"], grid["pp"]
    for mbs in values("mbs", divisors(sequences // dp)):
        if (sequences // dp) % mbs:
            continue
        grad_acc = sequences // (dp * mbs)
        if fixed.get("grad_acc", grad_acc) != grad_acc:
            continue
        engines = []
        for engine in (values("pp_engine", PP_ENGINES) if pp > 1
                       else (fixed.get("pp_engine", base["pp_engine"]),)):
            if engine != "interleaved" or pp == 1:
                engines.append((engine, fixed.get("interleave", base["interleave"])))
            elif grad_acc % pp == 0 and layers % pp == 0:
                engines += [(engine, v) for v in values("interleave", divisors(layers // pp))]
        for zero in values("zero", ZERO_STAGES):
            for recompute in values("recompute", RECOMPUTE):
                for recipe in values("fp8", fp8):
                    for engine, v in engines:
                        yield {**grid, "zero": zero, "mbs": mbs, "grad_acc": grad_acc,
                               "recompute": recompute, "fp8": recipe, "pp_engine": engine,
                               "interleave": v}


def grid_layouts(gpus: int, sequences: int, fixed: dict, base: dict, gpus_per_node=None):
    """(grid, why not) for every grid of `gpus` with its cp_mode: why not is '' or the reason
    no micro-batch x accumulation makes the global batch, or a launch would refuse the grid."""
    for grid in grids(gpus, fixed):
        modes = (fixed.get("cp_mode", base["cp_mode"]),) if grid["cp"] == 1 else (
            (fixed["cp_mode"],) if "cp_mode" in fixed else CP_MODES)
        for mode in modes:
            why = "" if sequences % grid["dp"] == 0 else (
                f"dp_size={grid['dp']} does not divide the global batch of {sequences} "
                f"sequences: no micro-batch x accumulation makes it")
            yield {**grid, "cp_mode": mode}, why or node_refusal(grid, gpus, gpus_per_node)


def search_raw(model_name: str, seq_len: int, overrides=()) -> dict:
    """The config dict a search starts from: the model as create_config.py resolves
    --model_name (preset, local folder, hub id), the sequence length, and `--set` overrides."""
    raw = Config().to_dict()
    raw["model"].update(resolve_model(model_name))
    raw["training"]["seq_length"] = seq_len
    apply_overrides(raw, list(overrides))
    return raw


def search(raw: dict, gpus: int, global_batch_tokens: int, profile, gpus_per_node: int = 8,
           fixed: dict = None, predict=None, keep_refused: bool = False,
           processes: int = None) -> SearchResult:
    """Judge and score every layout of `gpus` GPUs for the config `raw` (a config dict: its
    model, seq_length and any other key the user set; the layout's knobs are overwritten).
    `fixed`: knobs given by the user (short names), kept as given. `predict`: the step-time
    model, predict(config, profile, gpus_per_node) -> Prediction (default: step_time.predict,
    through step_time.predict_many: the same predictions, sharing their common pieces).
    `processes`: 1, or 2 to share the grids with a forked process (share_work.py: the same
    result); None: 2 where the machine lets this process run on two cores and there are
    SHARED_FROM layouts or more."""
    start = time.perf_counter()
    # a search makes some hundred thousand objects that live until it ends: the cyclic
    # collector's passes over them (a quarter of its time) would free next to nothing
    collecting = gc.isenabled()
    gc.disable()
    try:
        result = _search(raw, gpus, global_batch_tokens, profile, gpus_per_node, fixed, predict,
                         keep_refused, processes)
    finally:
        if collecting:
            gc.enable()
    result.seconds = time.perf_counter() - start
    return result


def _search(raw, gpus, global_batch_tokens, profile, gpus_per_node, fixed, predict,
            keep_refused, processes) -> SearchResult:
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(LAYOUT_KEYS))
    if unknown:
        raise ConfigError(f"not layout knobs: {', '.join(unknown)}; fix only "
                          f"{', '.join(LAYOUT_KEYS)}")
    # the knobs start from the defaults (a one-GPU layout) and the fixed ones are applied per
    # candidate, so a fixed value the config refuses is counted with its reason like any other
    raw = {section: dict(values) for section, values in raw.items()}
    for section, key in LAYOUT_KEYS.values():
        raw.setdefault(section, {})[key] = getattr(getattr(Config(), section), key)
    raw["training"]["fp8"] = "none"     # "auto" would ask this machine's GPU; each sets its own
    if raw["distributed"].get("zero3_keep_params"):     # the base itself must load
        raw["distributed"]["zero_stage"] = 3
    base = config_from_dict(raw, resolve=False)
    d = base.distributed
    sequences = global_sequences(global_batch_tokens, base.training.seq_length)
    defaults = {"cp_mode": d.cp_mode, "pp_engine": d.pp_engine, "interleave": d.pp_virtual_stages}
    result = SearchResult([], Counter(), {}, 0, base=base)
    layers, fp8 = base.model.num_hidden_layers, fp8_options(profile)

    def score_grids(grids: list) -> list:
        """[(layouts judged, [(layout, its Prediction, or why it was refused)])] of each
        (grid, why not, its layouts) of `grids`, the layouts in their order."""
        judged = []             # (layout, resolved Config or None, the refusal or '')
        counts = []
        for grid, why_not, layouts in grids:
            if why_not:
                judged.append((grid, None, why_not))
                counts.append((0, 1))
                continue
            verdict = grid_verdict(base, layouts, gpus)
            in_range = not verdict and knobs_in_range(layouts)
            for layout in layouts:
                config, errors = (None, [verdict]) if verdict else judge(base, layout, gpus,
                                                                         in_range)
                judged.append((layout, config, errors[0] if errors else ""))
            counts.append((len(layouts), len(layouts)))
        outcomes = iter([(layout, message if config is None else prediction)
                         for (layout, config, message), prediction in zip(
                             judged, _predictions(judged, profile, gpus_per_node, predict))])
        return [(considered, [next(outcomes) for _ in range(n)]) for considered, n in counts]
    # every layout judged and scored, grid by grid, shared with a second process where there
    # is one; then each judged layout's outcome counted in the order judged
    grids = [(grid, why_not, [] if why_not else list(subtree(grid, sequences, layers, fp8,
                                                              fixed, defaults)))
             for grid, why_not in grid_layouts(gpus, sequences, fixed, defaults, gpus_per_node)]
    if processes is None:       # a second process where it can pay for its fork and pickles
        processes = default_processes() if sum(len(g[2]) for g in grids) >= SHARED_FROM else 1
    # the grids of one pp share their pipelines' schedules: they stay in one process
    scored, result.processes = share_work(score_grids, grids, processes,
                                          kind=lambda item: item[0]["pp"],
                                          weight=lambda item: 1 + len(item[2]))
    for considered, outcomes in scored:
        result.considered += considered
        for layout, outcome in outcomes:
            if isinstance(outcome, str):
                key = reason(outcome)
                result.refused[key] += 1
                result.examples.setdefault(key, outcome)
                widen(result.spans, key, outcome)
                if keep_refused:
                    result.refused_layouts.append((layout, outcome))
            else:
                result.ranked.append(Scored(layout, outcome))
    # fastest first; of two as fast, the one that needs less memory
    result.ranked.sort(key=lambda s: (-s.prediction.tok_s_gpu, s.prediction.mem_gib))
    return result


def _predictions(judged: list, profile, gpus_per_node: int, predict) -> list:
    """The Prediction of each accepted layout of `judged` [(layout, Config or None, ...)],
    or for one that does not fit, its note; None for each refused one."""
    configs = [config for _, config, _ in judged if config is not None]
    if predict is None:     # the model, the pieces layouts share computed once
        from picotron.plan.step_time import cached_fit, predict_many
        # a layout that does not fit is refused on its memory alone, with the note predict
        # gives it (from the same estimate), and its step is not timed
        cache = {}
        fitted = [cached_fit(config, profile, cache) for config in configs]
        kept = [(config, fit) for config, fit in zip(configs, fitted) if fit[1]]
        timed = iter(predict_many([config for config, _ in kept], profile, gpus_per_node, cache,
                                  [fit for _, fit in kept]))
        scored = [next(timed) if fits else note for _, fits, note in fitted]
    else:
        scored = [predict(config, profile, gpus_per_node) for config in configs]
    scored = iter([_outcome(s) for s in scored])
    return [None if config is None else next(scored) for _, config, _ in judged]


def _outcome(scored):
    """A Prediction that fits, else why not: a refusal's note (predict's, or the memory's)."""
    if isinstance(scored, str):
        return scored or "does not fit"
    return scored if scored.fits else scored.note or "does not fit"
