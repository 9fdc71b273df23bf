"""The `h200` profile against this project's measured one-GPU rows
(bench/planner_data/h200_rows.csv, from bench/NOTES.md): every row is a layout the config
accepts, every one of them ran on one H200 so the planner must say it fits, and the rows whose
time the model covers (no `model_lacks`) are predicted within the planner's 10% goal. CPU
only: the model is arithmetic."""
import csv
import os

import pytest

from picotron.plan.hardware import load_profile
from picotron.plan.layouts import LAYOUT_COLUMNS, config_for
from picotron.plan.step_time import predict

ROWS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                    "planner_data", "h200_rows.csv")
GOAL = 0.10


def _rows():
    with open(ROWS, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_have_the_layout_columns_and_a_source():
    rows = _rows()
    assert rows
    for column in [*LAYOUT_COLUMNS, "measured_tok_s", "source", "model_lacks"]:
        assert column in rows[0], column
    assert all(r["source"] and float(r["measured_tok_s"]) > 0 for r in rows)


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{r['row']} ({r['source'][:14]})")
def test_measured_row_fits_and_is_predicted(row):
    prediction = predict(config_for(row), load_profile("h200"), int(row["gpus_per_node"]))
    assert prediction.fits, prediction.note          # it ran on one H200
    ratio = prediction.tok_s_gpu / float(row["measured_tok_s"])
    if not row["model_lacks"]:
        assert abs(ratio - 1) <= GOAL, f"predicted / measured = {ratio:.3f}"
