"""The config reference page, generated from the config itself:
`python -m picotron.config.reference > docs/config.md`.

Each key's type and default come from its dataclass (sections.py), its range from RANGES
(ranges.py), its meaning from help.json (one line a key, beside this file), and what `auto`
picks from `resolve_auto` itself, run for a few models on CPU and on a GPU with FP8 tensor
cores. So the page cannot drift from the code: tests/test_config_reference.py regenerates it
and fails when the two differ, and fails on a key that has no help line.
"""
import copy
import dataclasses
import json
import os
import sys
import typing

from picotron.config.checks import heartbeat_seconds
from picotron.config.config import Config, _type_name, config_from_dict, resolve_auto
from picotron.config.presets import resolve_model
from picotron.config.ranges import RANGES

HELP_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "help.json")
COMMAND = "python -m picotron.config.reference > docs/config.md"

INTRO = """\
The JSON config has six sections. Model keys use Hugging Face `LlamaConfig` names. A config
file names all six: a missing section is refused (rather than silently training on its
defaults), and an empty one, e.g. `"checkpoint": {}`, takes every default of that section; a
key left out of a section takes its default. Every number has a range (the table's range
column, from `picotron/config/ranges.py`: finite floats, positive sizes, timeouts up to a day,
sizes capped far above any real model), checked at load with a message naming the value, the
range and the default; a tokenizer or `init_from` path that does not exist, and a run,
checkpoint, TensorBoard or token-cache folder that cannot be written (or a folder where
metrics.jsonl, launches.jsonl or the checkpoints' `latest` goes) are refused before anything
is built (`picotron/run/output_paths.py`). A key given twice in one section (JSON would keep
the last silently) is refused. A path that starts with `~` (bash leaves it alone after `=`,
as in `--set logging.run_dir=~/runs/x`) is the home folder's, in every path key and script
argument. `create_config.py` fills the `model` section from `--model_name` (default
`debug`), so a new config holds that preset's sizes; the model defaults below are what a key
left out of a hand-written `model` section takes, with the `debug` preset's value beside
them where it differs.

Any key can be set for one launch with `train.py --set section.key=value` (checked like the
file, recorded in `RUN_DIR/launches.jsonl`), and in a new config with `create_config.py --set
section.key=value`.

The global batch is `micro_batch_size x gradient_accumulation_steps x dp_size` sequences; the
samples of step k are the same in every layout (numbered windows, `picotron/data/windows.py`).
"""

# The runs whose `auto` choices the page shows: (column title, preset, sections to set).
AUTO_CASES = [("CPU (`--use_cpu`)", "debug", {"distributed": {"use_cpu": True}}),
              ("one GPU, `debug`", "debug", {}),
              ("one GPU, SmolLM-360M", "SmolLM-360M", {}),
              ("one GPU, SmolLM-1.7B", "SmolLM-1.7B", {}),
              ("SmolLM-1.7B, tp 2", "SmolLM-1.7B", {"distributed": {"tp_size": 2}})]


def load_help() -> dict:
    with open(HELP_FILE, encoding="utf-8") as f:
        return json.load(f)


def config_keys() -> list:
    """Every `section.key` of the config, in the dataclasses' order."""
    return [f"{s}.{k}" for s, values in Config().to_dict().items() for k in values]


def as_json(value) -> str:
    """A default as a config file spells it: `true`, `null`, `"ring"`, 3e-4."""
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value)


def key_rows(section: str, help_text: dict, preset: dict) -> list:
    cls = typing.get_type_hints(Config)[section]
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        key = f"{section}.{f.name}"
        default = getattr(cls(), f.name)
        shown = f"`{as_json(default)}`"
        if section == "model" and f.name in preset and preset[f.name] != default:
            shown += f" (`debug`: `{as_json(preset[f.name])}`)"
        limits = str(RANGES[key][0]) if key in RANGES else ""
        rows.append(f"| `{key}` | {_type_name(hints[f.name])} | {shown} | {limits} | "
                    f"{help_text[key]} |")
    return rows


def auto_rows() -> list:
    """What each `auto` key (and heartbeat_s's null) resolves to, per case of AUTO_CASES."""
    chosen = []
    for _, preset, sections in AUTO_CASES:
        raw = {s: dict(sections.get(s, {})) for s in Config().to_dict()}
        raw["model"] = resolve_model(preset)
        world = raw["distributed"].get("tp_size", 1)
        config = copy.deepcopy(config_from_dict(raw, world_size=world, resolve=False))
        resolve_auto(config, fp8_tensor_cores=True)
        picks = {k: as_json(v) for k, v in config.auto_resolved.items()}
        picks["distributed.heartbeat_s"] = f"{heartbeat_seconds(config.distributed):g}"
        chosen.append(picks)
    keys = list(chosen[0])
    rows = ["| key | " + " | ".join(title for title, _, _ in AUTO_CASES) + " |",
            "|---|" + "---|" * len(AUTO_CASES)]
    for key in keys:
        rows.append(f"| `{key}` | " + " | ".join(f"`{c[key]}`" for c in chosen) + " |")
    return rows


def page() -> str:
    help_text = load_help()
    missing = [k for k in config_keys() if not help_text.get(k, "").strip()]
    unknown = sorted(set(help_text) - set(config_keys()))
    if missing or unknown:
        raise SystemExit(f"error: {HELP_FILE}: give every config key one help line; missing: "
                         f"{', '.join(missing) or 'none'}; not a key: {', '.join(unknown) or 'none'}")
    preset = resolve_model("debug")
    out = ["# Config reference", "",
           f"Generated by `{COMMAND}` from the typed config; edit `picotron/config/help.json` "
           "or the code, then run it again (a test fails when this page and the generator "
           "disagree).", "", INTRO.rstrip("\n"), ""]
    for section in Config().to_dict():
        out += [f"## {section}", ""] + key_rows(section, help_text, preset) + [""]
    out += ["## What `auto` picks", "",
            "Resolved at load by `resolve_auto` (`picotron/config/config.py`), for one rank "
            "unless the column says otherwise, on a GPU with FP8 tensor cores (an H100 or "
            "H200); `heartbeat_s` is its null at the default `timeout_s`. The run's first line "
            "prints its own choices (`auto on cuda: model.kernels=triton, ...`).", ""]
    out += auto_rows()
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(page())
