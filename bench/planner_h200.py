"""The `h200` hardware profile against this project's own measured one-GPU rows.

    python bench/planner_h200.py            # each row: measured, predicted, ratio
    python bench/planner_h200.py --fit      # fit the profile's "fit:" numbers, then judge

bench/planner_data/h200_rows.csv holds every one-GPU row of bench/NOTES.md measured by this
project's training path (bench_speed.py's and bench_fp8.py's "ours" rows, train.py, its runs
in fp8_convergence.py, the profiled steps): the layout columns of `python -m picotron.plan
score` (the shapes from configs/presets, the settings from each row's command), the config
keys the row set (`training.cuda_graphs`, `training.master_weights`,
`distributed.offload_optim_frac`), the measured tokens/s, the NOTES entry it comes from
(`source`), and `model_lacks`: for a row whose time depends on something step_time.py does not
model, what that is (empty otherwise).

--fit fits the numbers whose source in picotron/plan/hardware/h200.json starts with "fit:"
(no others) by least squares on log(predicted / measured) over the rows with an empty
`model_lacks`; every row is then predicted with the fitted numbers (in-sample for the rows
fit to), and again leaving each model out: fit on the other shapes' rows, predict the
held-out shape's (SmolLM-135M, SmolLM-360M, SmolLM-1.7B, Llama-3-8B and its deeper
variants). Rows that repeat one config (the same settings on other days) weigh it more.
"""
import argparse
import csv
import importlib.util
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from picotron.plan.hardware import load_profile  # noqa: E402
from picotron.plan.layouts import config_for  # noqa: E402
from picotron.plan.step_time import predict  # noqa: E402

ROWS = os.path.join(ROOT, "bench", "planner_data", "h200_rows.csv")
GOAL = 0.10                      # |predicted / measured - 1| the rows are judged against
# a fit number's bounds: efficiencies are shares of a peak; a half-size is a GEMM side
BOUNDS = {"gemm_eff": (0.05, 1.0), "fp8_gemm_eff": (0.05, 1.0), "attn_eff": (0.05, 1.0),
          "gemm_half_dim": (1.0, 4096.0), "attn_half_seq": (1.0, 65536.0),
          "launch_s": (1e-6, 1e-2), "fp8_launch_factor": (1.0, 4.0)}


def read_rows(path=ROWS) -> list:
    """The CSV's rows, each with its built Config (`config`), its measured tokens/s and the
    model it belongs to (the shape's name before any '@layers')."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["config"] = config_for(r)
        r["measured"] = float(r["measured_tok_s"])
        r["family"] = r["model"].split("@")[0]
    return rows


def fit_names(profile) -> list:
    """The profile's numbers its sources call a fit."""
    return [k for k, source in profile.sources.items() if source.startswith("fit:")]


def predicted(rows, profile) -> np.ndarray:
    return np.array([predict(r["config"], profile, int(r["gpus_per_node"])).tok_s_gpu
                     for r in rows])


def fit(rows, profile, names):
    """The profile with `names` refit to `rows` (least squares on log ratios; needs scipy)."""
    from scipy.optimize import least_squares
    start = np.array([profile[k] for k in names])
    low, high = zip(*(BOUNDS[k] for k in names))
    measured = np.array([r["measured"] for r in rows])

    def residuals(x):
        trial = profile.with_numbers(**dict(zip(names, x)))
        return np.log(predicted(rows, trial) / measured)

    result = least_squares(residuals, np.clip(start, low, high), bounds=(low, high),
                           x_scale=np.abs(start) + 1e-9, diff_step=1e-3)
    return profile.with_numbers(**dict(zip(names, result.x)))


def share_within(ratios) -> str:
    inside = sum(abs(q - 1) <= GOAL for q in ratios)
    return f"{inside} of {len(ratios)} ({100 * inside / max(1, len(ratios)):.0f}%)"


def table(rows, ratios, held_out=None) -> str:
    """A markdown table: every row, measured and predicted tokens/s, the ratio (and the
    leave-one-model-out ratio), and what the model lacks for it."""
    head = "| # | row | source | measured tok/s | predicted | ratio |"
    rule = "|---|---|---|---|---|---|"
    if held_out is not None:
        head, rule = head + " held out |", rule + "---|"
    lines = [head + " model lacks |", rule + "---|"]
    for i, (r, q) in enumerate(zip(rows, ratios), 1):
        mark = "" if abs(q - 1) <= GOAL else " **x**"
        line = (f"| {i} | {r['model']}: {r['row']} | {r['source']} | {r['measured']:,.0f} | "
                f"{r['measured'] * q:,.0f} | {q:.3f}{mark} |")
        if held_out is not None:
            h = held_out[i - 1]
            line += f" {h:.3f}{'' if abs(h - 1) <= GOAL else ' **x**'} |"
        lines.append(line + f" {r['model_lacks']} |")
    return "\n".join(lines)


def summary(rows, ratios, label) -> str:
    modelled = [q for r, q in zip(rows, ratios) if not r["model_lacks"]]
    errors = sorted(abs(q - 1) for q in modelled)
    return (f"{label}: within {GOAL:.0%}: {share_within(ratios)} of all rows, "
            f"{share_within(modelled)} of the rows the model covers; median |ratio - 1| "
            f"{100 * errors[len(errors) // 2]:.1f}%, worst {100 * errors[-1]:.1f}%")


def leave_one_model_out(rows, profile, names) -> np.ndarray:
    """Each row's ratio predicted by a profile fit without its model's rows."""
    out = np.zeros(len(rows))
    for family in sorted({r["family"] for r in rows}):
        train = [r for r in rows if r["family"] != family and not r["model_lacks"]]
        judged = [i for i, r in enumerate(rows) if r["family"] == family]
        refit = fit(train, profile, names)
        pred = predicted([rows[i] for i in judged], refit)
        out[judged] = pred / np.array([rows[i]["measured"] for i in judged])
        fitted = ", ".join(f"{k} {refit[k]:.4g}" for k in names)
        print(f"fit without {family}'s rows: {fitted}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--profile", default="h200",
                        help="the hardware profile judged (picotron/plan/hardware/NAME.json)")
    parser.add_argument("--rows", default=ROWS, help="the measured rows (CSV)")
    parser.add_argument("--fit", action="store_true",
                        help="refit the profile's 'fit:' numbers to the rows, then judge "
                             "in-sample and leaving each model out")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    rows = read_rows(args.rows)
    measured = np.array([r["measured"] for r in rows])
    ratios = predicted(rows, profile) / measured
    print(f"profile {profile.name} as stored: "
          + ", ".join(f"{k} {profile[k]:.4g}" for k in fit_names(profile)))
    print(summary(rows, ratios, "as stored"))
    if not args.fit:
        print(table(rows, ratios))
        return
    if importlib.util.find_spec("scipy") is None:
        raise SystemExit("bench/planner_h200.py --fit fits with scipy: pip install scipy")
    names = fit_names(profile)
    fitted = fit([r for r in rows if not r["model_lacks"]], profile, names)
    ratios = predicted(rows, fitted) / measured
    n_fit = sum(not r["model_lacks"] for r in rows)
    print(f"fit to {n_fit} rows (those with no 'model lacks'): "
          + ", ".join(f"{k} {fitted[k]:.4g}" for k in names))
    held = leave_one_model_out(rows, profile, names)
    print(summary(rows, ratios, "fitted, in-sample"))
    print(summary(rows, held, "leave one model out"))
    print(table(rows, ratios, held))
    if not math.isfinite(float(np.sum(np.log(ratios)))):
        raise SystemExit("a prediction is not finite")


if __name__ == "__main__":
    main()
