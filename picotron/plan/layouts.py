"""A layout as one row of a table (a CSV line of `python -m picotron.plan score`), and the
project's own Config built from it, so that every layout the planner scores is one the config
accepts, refused with the config's own message when it is not.

    row: layers hidden heads kv_heads ffn vocab tied seq gpus gpus_per_node
         dp tp pp cp zero mbs grad_acc   [recompute fp8 pp_engine gbs]   [section.key ...]

A column named `section.key` (e.g. `distributed.cp_mode`, `distributed.sequence_parallel`)
sets that key of the config as it is; its value is read as JSON when it parses (true, 4),
else as a string, and a blank cell leaves the key as it was. `pp_engine` may be
`interleaved:V`, V model chunks per pipeline rank. `gbs`, the sequences of a step where a
table states them, must be dp x mbs x grad_acc (batch_contradiction).
"""
import json

from picotron.config import Config, ConfigError, config_from_dict
from picotron.config.presets import resolve_model
from picotron.process_group_manager import check_nodes

LAYOUT_COLUMNS = ("layers hidden heads kv_heads ffn vocab tied seq gpus gpus_per_node "
                  "dp tp pp cp zero mbs grad_acc").split()
# columns a row may leave out, and what they then are
OPTIONAL_COLUMNS = {"recompute": "none", "fp8": "none", "pp_engine": "1f1b"}
# column -> (section, key) of the config; `gpus` and `gpus_per_node` are not config keys
# (gpus is the world size the config is checked against)
MODEL_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
              "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
              "ffn": "intermediate_size", "vocab": "vocab_size", "tied": "tie_word_embeddings"}
LAYOUT_KEYS = {"dp": ("distributed", "dp_size"), "tp": ("distributed", "tp_size"),
               "pp": ("distributed", "pp_size"), "cp": ("distributed", "cp_size"),
               "zero": ("distributed", "zero_stage"),
               "mbs": ("training", "micro_batch_size"),
               "grad_acc": ("training", "gradient_accumulation_steps"),
               "seq": ("training", "seq_length")}


def _int(column, value) -> int:
    """A CSV cell as an int ("4", "4.0", 4); a ValueError names the column."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"column '{column}' must be a whole number, got {value!r}") from None
    if number != int(number):
        raise ValueError(f"column '{column}' must be a whole number, got {value!r}")
    return int(number)


def _tied(value) -> bool:
    """The `tied` cell: 1 or 0, or true or false (any case); a ValueError names the column."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    number = _int("tied", value)
    if number not in (0, 1):
        raise ValueError(f"column 'tied' must be 1 or 0 (or true or false), got {value!r}")
    return bool(number)


def _cell(value):
    """A `section.key` cell: JSON when it parses (true, 4, 0.5), else the string itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _layout_dict(raw: dict, layout: dict) -> dict:
    """`raw` (a Config dict) with the layout's columns applied: the sizes, ZeRO, the batch,
    recomputation, FP8, the pipeline engine and any `section.key` column."""
    for column, (section, key) in LAYOUT_KEYS.items():
        if column in layout:
            raw[section][key] = _int(column, layout[column])
    recompute = layout.get("recompute", OPTIONAL_COLUMNS["recompute"])
    raw["training"]["activation_checkpointing"] = recompute or OPTIONAL_COLUMNS["recompute"]
    raw["training"]["fp8"] = layout.get("fp8", OPTIONAL_COLUMNS["fp8"]) or "none"
    engine = str(layout.get("pp_engine") or OPTIONAL_COLUMNS["pp_engine"])
    if ":" in engine:                                   # interleaved:V
        engine, chunks = engine.split(":", 1)
        raw["distributed"]["pp_virtual_stages"] = _int("pp_engine's V", chunks)
    raw["distributed"]["pp_engine"] = engine
    for column, value in layout.items():
        if "." in column and value not in ("", None):        # a blank cell sets nothing
            section, key = column.split(".", 1)
            raw.setdefault(section, {})[key] = _cell(value)
    # the positions the model is built for: at least the sequence trained on
    seq = raw["training"]["seq_length"]
    raw["model"]["max_position_embeddings"] = max(raw["model"]["max_position_embeddings"], seq)
    raw["dataset"]["name"] = "synthetic"                # a plan reads no data
    return raw


def batch_contradiction(row: dict) -> str:
    """Why a row whose optional `gbs` column (sequences a step) is not its dp x mbs x grad_acc
    does not describe one run, or '' (no gbs, a blank one, or the two agree): which of its
    numbers is wrong, the row cannot tell."""
    if row.get("gbs") in (None, ""):
        return ""
    sequences = _int("dp", row["dp"]) * _int("mbs", row["mbs"]) * _int("grad_acc", row["grad_acc"])
    stated = _int("gbs", row["gbs"])
    if sequences == stated:
        return ""
    return (f"the row's batch contradicts itself: dp x mbs x grad_acc = {sequences} sequences, "
            f"gbs = {stated}; fix whichever is wrong")


def as_trainer_ran(row: dict, profile) -> dict:
    """`row` with the config keys the profile's trainer ran every layout with (its trait
    layout_defaults, `section.key` -> value) where the row does not set them: a table of
    layouts is read as the trainer whose runs fit the profile ran them (nanotron's tensor
    parallelism, REDUCE_SCATTER mode, is sequence parallelism; this project's default is
    off), and a cell the row fills wins."""
    given = {column: value for column, value in row.items() if value not in ("", None)}
    return {**row, **profile.traits.get("layout_defaults", {}), **given}


def config_for(row: dict, use_cpu: bool = False) -> Config:
    """The Config of one layout row (LAYOUT_COLUMNS, optionally OPTIONAL_COLUMNS and
    `section.key` columns). A row the config refuses raises its ConfigError unchanged; a
    column that is missing or not a number raises ValueError naming it."""
    missing = [c for c in LAYOUT_COLUMNS if c not in row or row[c] in (None, "")]
    if missing:
        raise ValueError(f"the row has no {', '.join(missing)}: a layout row needs every one "
                         f"of {' '.join(LAYOUT_COLUMNS)}")
    raw = Config().to_dict()
    for column, key in MODEL_KEYS.items():
        raw["model"][key] = _tied(row[column]) if column == "tied" else _int(column, row[column])
    raw["model"]["name"] = row.get("model") or "layout"
    raw["distributed"]["use_cpu"] = use_cpu
    if use_cpu:
        raw["training"]["dtype"] = "float32"
    _layout_dict(raw, row)
    return config_from_dict(raw, world_size=_int("gpus", row["gpus"]))


def config_for_model(model_name: str, use_cpu: bool = False, **layout) -> Config:
    """The Config of `model_name` (a preset, a Hugging Face id or a local folder, resolved as
    create_config.py resolves --model_name) laid out by `layout`'s columns (dp, tp, pp, cp,
    zero, mbs, grad_acc, seq, recompute, fp8, pp_engine, `section.key`; `gpus`, when given,
    is the world size checked). A layout the config refuses raises its ConfigError."""
    raw = Config().to_dict()
    raw["model"].update(resolve_model(model_name))
    raw["distributed"]["use_cpu"] = use_cpu
    if use_cpu:
        raw["training"]["dtype"] = "float32"
    _layout_dict(raw, layout)
    gpus = layout.get("gpus")
    return config_from_dict(raw, world_size=None if gpus is None else _int("gpus", gpus))


def row_of(config, gpus_per_node: int) -> dict:
    """The layout row of a Config (LAYOUT_COLUMNS and OPTIONAL_COLUMNS), its inverse."""
    m, d, t = config.model, config.distributed, config.training
    engine = d.pp_engine if d.pp_engine != "interleaved" else f"interleaved:{d.pp_virtual_stages}"
    return {"layers": m.num_hidden_layers, "hidden": m.hidden_size,
            "heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads,
            "ffn": m.intermediate_size, "vocab": m.vocab_size,
            "tied": int(m.tie_word_embeddings), "seq": t.seq_length,
            "gpus": config.world_size, "gpus_per_node": gpus_per_node,
            "dp": d.dp_size, "tp": d.tp_size, "pp": d.pp_size, "cp": d.cp_size,
            "zero": d.zero_stage, "mbs": t.micro_batch_size,
            "grad_acc": t.gradient_accumulation_steps,
            "recompute": t.activation_checkpointing, "fp8": t.fp8, "pp_engine": engine}


def node_refusal(grid: dict, gpus: int, gpus_per_node) -> str:
    """Why a launch of `grid` ({"tp": .., "cp": ..}) on nodes of `gpus_per_node` GPUs is
    refused (a tensor-parallel group across two nodes: process_group_manager.check_nodes),
    or '' (also when no node size is given)."""
    if not gpus_per_node:
        return ""
    try:
        check_nodes(grid["tp"], grid["cp"], gpus_per_node, gpus)
    except ConfigError as refused:
        return str(refused)
    return ""

