"""The config's verdict on one layout of a search: the body of config_from_dict without its
type checks (every knob of a search is typed by construction), on a copy of the search's base
config with the layout's knobs set. A layout is a dict of LAYOUT_KEYS' short names.
"""
import functools

from picotron.config import Config, resolve_auto
from picotron.config.checks import layout_errors
from picotron.config.ranges import RANGES

# short name -> (section, key) of the config; the CSV columns and the table use the short names
LAYOUT_KEYS = {
    "dp": ("distributed", "dp_size"), "tp": ("distributed", "tp_size"),
    "pp": ("distributed", "pp_size"), "cp": ("distributed", "cp_size"),
    "cp_mode": ("distributed", "cp_mode"), "zero": ("distributed", "zero_stage"),
    "mbs": ("training", "micro_batch_size"),
    "grad_acc": ("training", "gradient_accumulation_steps"),
    "recompute": ("training", "activation_checkpointing"), "fp8": ("training", "fp8"),
    "pp_engine": ("distributed", "pp_engine"), "interleave": ("distributed", "pp_virtual_stages"),
}


def knobs_set(raw: dict, overrides) -> dict:
    """The layout knobs (short names) that `--set section.key=value` overrides name, with
    their values as `raw` (the config dict the overrides were applied to) holds them: the
    knobs a search keeps fixed. A knob set to "auto" is left to the search, whose choice is
    the planner's (resolved here, "auto" would ask this machine's GPU, not the profile's)."""
    named = {item.split("=", 1)[0].strip() for item in overrides}
    return {knob: raw[section][key] for knob, (section, key) in LAYOUT_KEYS.items()
            if f"{section}.{key}" in named and raw[section][key] != "auto"}


def _copy(section):
    """A shallow copy of a config section: dataclasses.replace(section) without its __init__
    (the sections are plain dataclasses: no __post_init__, every field an init field)."""
    copy = object.__new__(type(section))
    copy.__dict__.update(section.__dict__)
    return copy


def with_layout(base: Config, layout: dict) -> Config:
    """`base` (as given, "auto" unresolved) with the layout's knobs set; sections the layout
    does not touch are shared, not copied."""
    config, distributed, training = _copy(base), _copy(base.distributed), _copy(base.training)
    config.distributed, config.training = distributed, training
    fields = {"distributed": distributed.__dict__, "training": training.__dict__}
    for name, value in layout.items():     # plain dataclasses: a field is a __dict__ entry
        section, key = LAYOUT_KEYS[name]
        fields[section][key] = value
    return config


def judge(base: Config, layout: dict, gpus: int, in_range: bool = False):
    """(resolved Config, []) when the config accepts the layout, else (None, its errors): what
    config_from_dict(raw, world_size=gpus) decides, for a raw dict whose types are right.
    `base` passed config_from_dict, so of range_errors only the knobs' own ranges can fail
    (its other checks read the dataset section, which the layout does not touch); `in_range`:
    the knobs are known to be in their ranges (knobs_in_range)."""
    errors = [] if in_range else knob_range_errors(layout)
    if errors:
        return None, errors
    resolved = with_layout(base, layout)        # its own sections, resolved in place
    resolved.model = _copy(base.model)
    resolve_auto(resolved)
    errors = layout_errors(resolved, gpus)
    return (None, errors) if errors else (resolved, [])


def knob_range_errors(layout: dict) -> list:
    """range_errors' message for each knob of `layout` outside its range (RANGES' own)."""
    errors = []
    for name, value in layout.items():
        message = _knob_range_error(name, value)
        if message:
            errors.append(message)
    return errors


def knobs_in_range(layouts: list) -> bool:
    """Whether every knob of every layout is in its range: the values of a grid's layouts are
    few (each knob's options, or the one value the user fixed), so each is looked up once."""
    values = set()
    for layout in layouts:
        values.update(layout.items())
    return not any(_knob_range_error(name, value) for name, value in values)


@functools.lru_cache(maxsize=4096, typed=True)
def _knob_range_error(name: str, value) -> str:
    """One knob's range_errors message, '' in range: a function of the value alone."""
    section, key = LAYOUT_KEYS[name]
    allowed, why = RANGES.get(f"{section}.{key}", (None, ""))
    problem = allowed.problem(value) if allowed is not None else None
    if not problem:
        return ""
    default = getattr(getattr(Config(), section), key)
    return (f"{section}.{key}={value!r} {problem} ({why}); set it in {allowed}, "
            f"e.g. {default!r} (the default)")


def grid_verdict(base: Config, layouts: list, gpus: int) -> str:
    """The config's first error for a grid whose layouts it refuses for the grid alone, else
    ''. Its first and last layouts differ in every other knob that has a choice (ZeRO 0 and 3,
    the smallest and largest micro-batch, none and the last recomputation, FP8 off and on,
    afab and interleaved): refused by both with one message, the grid is what it refuses
    (tests/test_plan_search.py holds the search to a brute-force filter)."""
    if not layouts:
        return ""
    first, last = judge(base, layouts[0], gpus)[1], judge(base, layouts[-1], gpus)[1]
    return first[0] if first and last and first[0] == last[0] else ""
