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
"""
import functools
import gc
import re
import time
from collections import Counter, namedtuple
from dataclasses import dataclass, field

from picotron.config import Config, ConfigError, config_from_dict
from picotron.config.overrides import apply_overrides
from picotron.config.presets import resolve_model
from picotron.config.checks import CHECKPOINTING, CP_MODES, PP_ENGINES
from picotron.plan.judge import LAYOUT_KEYS, grid_verdict, judge, knobs_in_range
from picotron.plan.layouts import node_refusal

RECOMPUTE = tuple(c for c in CHECKPOINTING if c != "auto")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class Scored:
    layout: dict            # short name -> value, every knob of LAYOUT_KEYS
    prediction: object      # step_time.Prediction


# a layout's outcome where memory alone refuses it: as a Prediction's fits and note
Unfit = namedtuple("Unfit", "fits note")


@dataclass
class SearchResult:
    ranked: list            # Scored that fit, fastest (tok/s/GPU) first
    refused: Counter        # reason (numbers masked as N) -> layouts refused for it
    examples: dict          # reason -> the first full message given for it
    considered: int         # candidates judged
    seconds: float = 0.0
    refused_layouts: list = field(default_factory=list)   # (layout, message), when kept


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


@functools.lru_cache(maxsize=65536)
def reason(message: str) -> str:
    """A refusal's message with its numbers masked, so that layouts refused by one rule count
    together ('tp_size=16' and 'tp_size=32' alike)."""
    return re.sub(r"\d+(\.\d+)?", "N", message)


def search_raw(model_name: str, seq_len: int, overrides=()) -> dict:
    """The config dict a search starts from: the model as create_config.py resolves
    --model_name (preset, local folder, hub id), the sequence length, and `--set` overrides."""
    raw = Config().to_dict()
    raw["model"].update(resolve_model(model_name))
    raw["training"]["seq_length"] = seq_len
    apply_overrides(raw, list(overrides))
    return raw


def search(raw: dict, gpus: int, global_batch_tokens: int, profile, gpus_per_node: int = 8,
           fixed: dict = None, predict=None, keep_refused: bool = False) -> SearchResult:
    """Judge and score every layout of `gpus` GPUs for the config `raw` (a config dict: its
    model, seq_length and any other key the user set; the layout's knobs are overwritten).
    `fixed`: knobs given by the user (short names), kept as given. `predict`: the step-time
    model, predict(config, profile, gpus_per_node) -> Prediction (default: step_time.predict,
    through step_time.predict_many: the same predictions, sharing their common pieces)."""
    start = time.perf_counter()
    # a search makes some hundred thousand objects that live until it ends: the cyclic
    # collector's passes over them (a quarter of its time) would free next to nothing
    collecting = gc.isenabled()
    gc.disable()
    try:
        result = _search(raw, gpus, global_batch_tokens, profile, gpus_per_node, fixed, predict,
                         keep_refused)
    finally:
        if collecting:
            gc.enable()
    result.seconds = time.perf_counter() - start
    return result


def _search(raw, gpus, global_batch_tokens, profile, gpus_per_node, fixed, predict,
            keep_refused) -> SearchResult:
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
    result = SearchResult([], Counter(), {}, 0)

    def refuse(layout, message):
        key = reason(message)
        result.refused[key] += 1
        result.examples.setdefault(key, message)
        if keep_refused:
            result.refused_layouts.append((layout, message))
    layers = base.model.num_hidden_layers
    judged = []             # (layout, resolved Config or None, the refusal or '')
    for grid, why_not in grid_layouts(gpus, sequences, fixed, defaults, gpus_per_node):
        if why_not:
            judged.append((grid, None, why_not))
            continue
        layouts = list(subtree(grid, sequences, layers, fp8_options(profile), fixed, defaults))
        verdict = grid_verdict(base, layouts, gpus)
        in_range = not verdict and knobs_in_range(layouts)
        for layout in layouts:
            result.considered += 1
            config, errors = (None, [verdict]) if verdict else judge(base, layout, gpus,
                                                                     in_range)
            judged.append((layout, config, errors[0] if errors else ""))
    # every accepted layout scored, then each judged layout's outcome in the order judged
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
        predictions = (next(timed) if fits else Unfit(False, note) for _, fits, note in fitted)
    else:
        predictions = (predict(config, profile, gpus_per_node) for config in configs)
    for layout, config, message in judged:
        if config is None:
            refuse(layout, message)
            continue
        prediction = next(predictions)
        if not prediction.fits:
            refuse(layout, prediction.note or "does not fit")
            continue
        result.ranked.append(Scored(layout, prediction))
    # fastest first; of two as fast, the one that needs less memory
    result.ranked.sort(key=lambda s: (-s.prediction.tok_s_gpu, s.prediction.mem_gib))
    return result
