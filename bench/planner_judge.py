"""The four measures the planner is judged by, per (model, nodes) cell of measured runs
(bench/planner_data/calibration.csv), used by bench/planner_fit.py:

    pick      the measured tokens/s of the layout the planner ranks first among those it
              predicts to fit (a crashed or out-of-memory row it picks counts as 0), over
              the best measured; "ok" when within 10% of the best
    spearman  rank correlation of predicted and measured tokens/s over the cell's runs that ran
    |p/m-1|   median relative error of the predicted tokens/s over those runs
    fit%      share of the runs that ran that the planner predicts to fit
and, beside them, `near`: how many of the cell's runs that ran are within 10% of its best, the
runs a pick can hit (1 where a single run, far faster than its like, decides the cell)

The goals: the pick within 10% in at least 80% of the cells, a median spearman of at least
0.8, a median error of at most 15%, and at least 95% of the runs that ran predicted to fit.
"""
import csv
import os
import sys
from collections import defaultdict

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from picotron.errors import ConfigError  # noqa: E402
from picotron.plan.hardware import load_profile  # noqa: E402
from picotron.plan.layouts import as_trainer_ran, batch_contradiction, config_for  # noqa: E402
from picotron.plan.step_time import predict  # noqa: E402

DATA = os.path.join(ROOT, "bench", "planner_data", "calibration.csv")
GOALS = {"picks": 0.8, "spearman": 0.8, "error": 0.15, "fit": 0.95}


def load_runs(path=DATA):
    """[(row, Config)] of every row the config accepts, and the count of those it refuses (a
    pipeline deeper than the layers) or that contradict themselves (dp x mbs x grad_acc is
    not their global batch `gbs`: 20 rows of the figure). Each row is read as `score` reads
    it under playbook-h100 (layouts.as_trainer_ran: nanotron's REDUCE_SCATTER mode is
    sequence parallelism)."""
    runs, refused = [], 0
    nanotron = load_profile("playbook-h100")
    with open(path) as f:
        for row in csv.DictReader(f):
            if batch_contradiction(row):
                refused += 1
                continue
            try:
                runs.append((row, config_for(as_trainer_ran(row, nanotron))))
            except ConfigError:
                refused += 1
    return runs, refused


def predictions(profile, runs):
    return [predict(config, profile, int(row["gpus_per_node"])) for row, config in runs]


def spearman(a, b) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):            # ties share their mean rank
            same = x == v
            r[same] = r[same].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def judge(profile, runs):
    """[(model, nodes, pick share, ok, spearman, median |p/m-1|, fit share, ran rows, runs
    within 10% of the best)]."""
    cells = defaultdict(list)
    for (row, _), q in zip(runs, predictions(profile, runs)):
        cells[(row["model"], int(row["nodes"]))].append((row, q))
    out = []
    for (model, nodes), pairs in sorted(cells.items()):
        ran = [(r, q) for r, q in pairs if r["status"] == "ran"]
        if not ran:
            continue
        best = max(float(r["measured_tok_s_gpu"]) for r, _ in ran)
        fitting = [(r, q) for r, q in pairs if q.fits] or pairs
        row, _ = max(fitting, key=lambda rq: rq[1].tok_s_gpu)
        got = float(row["measured_tok_s_gpu"]) if row["status"] == "ran" else 0.0
        meas = [float(r["measured_tok_s_gpu"]) for r, _ in ran]
        pred = [q.tok_s_gpu for _, q in ran]
        rho = spearman(pred, meas) if len(ran) > 2 else float("nan")
        err = float(np.median([abs(p / m - 1) for p, m in zip(pred, meas)]))
        share = sum(q.fits for _, q in ran) / len(ran)
        near = sum(m >= 0.9 * best for m in meas)
        out.append((model, nodes, got / best, got >= 0.9 * best, rho, err, share, len(ran), near))
    return out


def summary(cells) -> dict:
    ran = sum(c[7] for c in cells)
    return {"picks": sum(c[3] for c in cells) / len(cells),
            "spearman": float(np.nanmedian([c[4] for c in cells])),
            "error": float(np.median([c[5] for c in cells])),
            "fit": sum(c[6] * c[7] for c in cells) / ran}


def report(title, cells) -> list:
    lines = [f"{title}", f"  {'model':5s} {'nodes':>5s} {'rows':>4s} {'pick':>6s} {'ok':>3s} "
                         f"{'spearman':>8s} {'|p/m-1|':>7s} {'fit%':>5s} {'near':>4s}"]
    for model, nodes, pick, ok, rho, err, share, n, near in cells:
        lines.append(f"  {model:5s} {nodes:5d} {n:4d} {pick:6.2f} {'ok' if ok else '--':>3s} "
                     f"{rho:8.2f} {err:7.2f} {100 * share:5.0f} {near:4d}")
    s = summary(cells)
    met = {k: (s[k] <= GOALS[k] if k == "error" else s[k] >= GOALS[k]) for k in GOALS}
    lines.append(f"  picks within 10% of the best: {sum(c[3] for c in cells)}/{len(cells)} "
                 f"({s['picks']:.0%}, goal 80%: {'met' if met['picks'] else 'NOT met'}); "
                 f"median spearman {s['spearman']:.2f} (goal 0.8: "
                 f"{'met' if met['spearman'] else 'NOT met'}); median |p/m-1| {s['error']:.2f} "
                 f"(goal 0.15: {'met' if met['error'] else 'NOT met'}); runs that ran "
                 f"predicted to fit {s['fit']:.1%} (goal 95%: {'met' if met['fit'] else 'NOT met'})")
    return lines
