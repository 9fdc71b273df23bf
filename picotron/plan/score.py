"""`python -m picotron.plan score --layouts IN.csv --hardware P --out OUT.csv`: the step-time
model's prediction for every row of a table of layouts. OUT.csv is IN.csv with every column
kept, in its order, plus the predictions (PRED_COLUMNS); a row the config refuses gets
pred_fits 0 and the config's reason in pred_note; one that does not fit the memory, pred_fits
0, the memory's reason, and its time at the profile's over_memory_speed. search_rows writes a
search's ranked layouts as such a table (`search --out`), which score reads back to the same
predictions.

IN.csv's columns: layouts.LAYOUT_COLUMNS, optionally layouts.OPTIONAL_COLUMNS, `gbs` and any
`section.key` column (layouts.py says how each is read); a row whose gbs is not its dp x mbs x
grad_acc gets pred_fits 0 and both numbers in pred_note. A file without some of the columns,
or a row that is not a layout (a size that is not a number), ends in one line naming them.
"""
import csv
import json
import os

from picotron.config import Config
from picotron.errors import ConfigError
from picotron.plan.judge import LAYOUT_KEYS as KNOB_KEYS, with_layout
from picotron.plan.layouts import (LAYOUT_COLUMNS, MODEL_KEYS, OPTIONAL_COLUMNS, as_trainer_ran,
                                   batch_contradiction, config_for, row_of)

PRED_COLUMNS = ("pred_tok_s_gpu", "pred_step_s", "pred_mem_gib", "pred_fits", "pred_note")


def one_line(message: str) -> str:
    """The config's message ('invalid config:\\n  - a\\n  - b') as one CSV cell: 'a; b'."""
    lines = [line.strip().removeprefix("- ") for line in str(message).splitlines()]
    return "; ".join(line for line in lines if line and line != "invalid config:")


def read_layouts(path: str) -> tuple:
    """(columns, rows) of IN.csv; a ConfigError names every missing column."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            rows = list(reader)
    except OSError as e:
        raise ConfigError(f"cannot read --layouts '{path}': {e.strerror}; give a CSV file "
                          f"with the columns {' '.join(LAYOUT_COLUMNS)}") from None
    missing = [c for c in LAYOUT_COLUMNS if c not in columns]
    if missing:
        raise ConfigError(f"--layouts {path} has no column {', '.join(missing)}; a layout "
                          f"table needs every one of: {' '.join(LAYOUT_COLUMNS)}")
    return columns, rows


def score_row(row: dict, profile, predict) -> dict:
    """The prediction columns of one row, read as the profile's trainer ran it (a key the
    row does not set: layouts.as_trainer_ran); a ConfigError ends in one line (row not a
    layout)."""
    refused = batch_contradiction(row)        # not one run: its layout and batch disagree
    if not refused:
        try:
            config = config_for(as_trainer_ran(row, profile))
        except ConfigError as e:              # a layout the config refuses: its reason
            refused = one_line(e)
    if refused:
        return {"pred_tok_s_gpu": "", "pred_step_s": "", "pred_mem_gib": "", "pred_fits": 0,
                "pred_note": refused}
    return pred_cells(predict(config, profile, int(float(row["gpus_per_node"]))), profile)


def pred_cells(p, profile) -> dict:
    """The PRED_COLUMNS of a step_time.Prediction."""
    note = p.note
    if p.parts.get("memory_pressure", 0.0) > 0:     # the time of a run past its memory
        note += (f"; timed, where it runs at all, at {profile['over_memory_speed']:.2f} of its "
                 f"speed (the profile's over_memory_speed: the allocator retries at capacity)")
    return {"pred_tok_s_gpu": f"{p.tok_s_gpu:.1f}", "pred_step_s": f"{p.step_s:.6g}",
            "pred_mem_gib": f"{p.mem_gib:.4g}", "pred_fits": int(p.fits), "pred_note": note}


def score(in_path: str, profile, out_path: str, predict=None) -> int:
    """Write OUT.csv; return the number of rows scored."""
    if predict is None:
        from picotron.plan.step_time import predict
    columns, rows = read_layouts(in_path)
    scored = []
    for number, row in enumerate(rows, start=2):          # line 1 is the header
        try:
            scored.append({**row, **score_row(row, profile, predict)})
        except ValueError as e:
            raise ConfigError(f"--layouts {in_path} line {number} is not a layout: {e}; fix "
                              f"that cell") from None
    write_table(out_path, columns + [c for c in PRED_COLUMNS if c not in columns], scored)
    return len(scored)


def write_table(path: str, columns: list, rows: list) -> None:
    """Write `rows` (dicts) as a CSV of `columns`; a path that cannot be written ends in one
    line."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    except OSError as e:
        raise ConfigError(f"cannot write --out {path!r} ({e.strerror}); choose a path in a "
                          f"folder you can write") from None


# what a layout's prediction reads of a config: its other sections (data, logging) are not it
PLANNED_SECTIONS = ("model", "distributed", "training")


def search_rows(result, profile, gpus_per_node: int) -> tuple:
    """(columns, rows) of a search's ranked layouts (search.SearchResult), fastest first, as
    score reads a layout: each one's layouts.row_of, `distributed.cp_mode`, a `section.key`
    column for each key of the search's config that is not the default (the model's other
    settings, each --set) or that the profile's trait layout_defaults names (score would read
    it as that trainer ran it), then PRED_COLUMNS."""
    default, base = Config().to_dict(), result.base.to_dict()
    laid_out = {("model", key) for key in MODEL_KEYS.values()} | set(KNOB_KEYS.values()) | {
        ("model", "name"), ("training", "seq_length")}
    settings = {(section, key): value for section in PLANNED_SECTIONS
                for key, value in base[section].items()
                if (section, key) not in laid_out and value != default[section].get(key)}
    for name in profile.traits.get("layout_defaults", {}):
        section, key = name.split(".", 1)
        settings.setdefault((section, key), base[section][key])
    cells = {f"{section}.{key}": value if isinstance(value, str) else json.dumps(value)
             for (section, key), value in settings.items()}
    rows = [{"model": base["model"]["name"],
             **row_of(with_layout(result.base, scored.layout), gpus_per_node),
             "distributed.cp_mode": scored.layout["cp_mode"], **cells,
             **pred_cells(scored.prediction, profile)} for scored in result.ranked]
    columns = (["model"] + LAYOUT_COLUMNS + list(OPTIONAL_COLUMNS) + ["distributed.cp_mode"]
               + list(cells) + list(PRED_COLUMNS))
    return columns, rows
