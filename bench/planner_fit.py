"""Fit the playbook-h100 profile's free numbers to the Ultra-Scale Playbook's measured runs
(bench/planner_data/calibration.csv) and report how well the planner predicts them, in sample
and leave-one-model-out (fit on 1B, judge 8B, and the reverse), by the four measures of
bench/planner_judge.py.

    python bench/planner_fit.py [--per_cell 30] [--max_evals 60] [--write]

The free numbers (FREE, the rest of the profile stays as its sources say), in two fits:
- memory, linear in its three numbers: the runs' measured peak = mem_held_factor x the memory
  plan's held bytes + mem_act_factor x the rest + mem_logit_bytes x the micro-batch's logits
  (the profile's, not fit) + mem_extra_gib, least squares on the relative error over the runs
  that ran; then mem_margin, the share of the GPU a layout must leave free to be predicted to
  fit: the memory the model leaves out (measured - predicted GiB) in all but 5% of the runs
  that ran, over the usable memory;
- time: the rest of FREE (the links' bandwidth and latencies, the host's, the stall's),
  minimising the robust (Cauchy) sum of log(predicted / measured) tokens/s per GPU over the
  runs that ran, each (model, nodes) cell weighted alike, on up to --per_cell rows of each
  cell (the predictor is the cost; the report judges every row), each fit from the same
  starts (START, and START with the link at a half and a quarter of the NIC's rate: LINK_STARTS),
  none of them read off the runs, keeping the least loss (one start alone can stop in a basin
  another start beats: fit on 1B, the link at 29 GB/s a GPU, where 15 GB/s fits its runs
  better);
- over_memory_speed last: the median of measured / predicted speed over the runs that ran
  though predicted not to fit, where at least MIN_PAST_MEMORY of the runs fit to are such (the
  speed a layout past its memory runs at, where it runs at all); with fewer the runs cannot
  tell it, and it stays 1 (no slowdown).
--write stores the in-sample fit in picotron/plan/hardware/playbook-h100.json. Needs scipy.
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import re
from collections import defaultdict

import numpy as np

from planner_judge import ROOT, judge, load_runs, predictions, report

from picotron.plan.hardware import HERE, load_profile
from picotron.plan.memory_plan import GPU_RESERVED
from picotron.plan.memory_state import GiB
from picotron.plan.nanotron_memory import rank_need, rank_parts
from picotron.plan.trainer_memory import (counts_nanotron, held_and_device, logit_count,
                                          memory_fit)

MEMORY = ("mem_held_factor", "mem_act_factor", "mem_extra_gib")
# the quantile of the memory the model leaves out (measured - predicted) that the margin covers
MARGIN_QUANTILE = 0.95
# name -> (low, high, fit in log space)
# the log error beyond which a run counts as an outlier (Cauchy's loss): the runs whose
# network stalled are 10-100x slower than any model of the step, and must not steer it
SCALE = 0.2
# the link between nodes is bounded by the NIC's 400 Gb/s (50 GB/s) a GPU: a faster fit would
# price a data-parallel reduction at more than the hardware moves
FREE = {"gemm_eff": (0.2, 0.95, False), "inter_bytes_per_s": (1e8, 5e10, True),
        "inter_latency_s": (1e-6, 1e-2, True), "dp_latency_s": (1e-7, 1e-2, True),
        "inter_latency_pp_s": (1e-6, 0.05, True), "intra_latency_pp_s": (1e-7, 0.01, True),
        "tp_exposed": (0.0, 1.0, False), "launch_s": (1e-6, 0.02, True),
        "micro_s": (1e-5, 0.3, True), "send_s": (1e-6, 0.3, True),
        "stall_s": (1e-3, 5.0, True), "stall_half_nodes": (2.0, 512.0, True),
        "stall_steepness": (0.5, 8.0, False)}
# where every time fit starts, whichever runs it is fit to: numbers from no run of the
# Playbook's (the h200 profile's host and GEMM, the NIC's datasheet, nanotron's TP without
# overlap, a stall of a tenth of a second at the largest job), so a fit on one model carries
# nothing of the other model's runs, as a start at the stored profile (fit on both) would
START = {"gemm_eff": 0.7761, "inter_bytes_per_s": 5e10, "inter_latency_s": 2.5e-5,
         "dp_latency_s": 2.5e-5, "inter_latency_pp_s": 2.5e-5, "intra_latency_pp_s": 5e-6,
         "tp_exposed": 1.0, "launch_s": 1.085e-3, "micro_s": 1e-4, "send_s": 1e-4,
         "stall_s": 0.1, "stall_half_nodes": 64.0, "stall_steepness": 4.0}
# the link between nodes at which the time fit also starts: the NIC's rate, its half and its
# quarter (NCCL over the NIC reaching part of it); on 1B's runs alone the link trades against
# gemm_eff, and a single start stops in whichever basin it meets first
LINK_STARTS = (5e10, 2.5e10, 1.25e10)
# the least runs predicted not to fit, that ran, from which over_memory_speed is read
MIN_PAST_MEMORY = 5


def fit_memory(profile, runs) -> dict:
    """The MEMORY numbers, by non-negative least squares on predicted / measured - 1 over the
    runs that ran (linear in them); the logits' bytes stay the profile's (the 8B runs alone
    cannot tell them from the activations, both grow with the micro-batch)."""
    from scipy.optimize import nnls
    ran = [(row, config) for row, config in runs if row["status"] == "ran"]
    parts, rest = [], []
    for row, config in ran:
        if counts_nanotron(config, profile):
            # the Playbook's memory is world rank 0's, the first pipeline stage's: nanotron's
            # benchmark mode writes its CSV row, and that rank's peak, from world rank 0
            held, other, logits = rank_parts(config, profile, 0)
        else:
            held, device = held_and_device(config)
            other, logits = device - held, logit_count(config)
        parts.append((held / GiB, other / GiB, 1.0))
        rest.append(float(row["measured_mem_gb"]) - profile["mem_logit_bytes"] * logits / GiB)
    x, m = np.array(parts), np.array([float(row["measured_mem_gb"]) for row, _ in ran])
    coef, _ = nnls(x / m[:, None], np.array(rest) / m)     # no factor below zero
    numbers = dict(zip(MEMORY, (float(c) for c in coef)))
    # the margin: what the model leaves out of a run's memory, in GiB (an error that carries
    # from one model's runs to another's, where their headroom does not), but for 5% of them
    need = x @ coef + (m - np.array(rest))
    usable = profile["memory_gib"] - GPU_RESERVED / GiB
    numbers["mem_margin"] = max(0.0, float(np.quantile(m - need, MARGIN_QUANTILE) / usable))
    return numbers


def measured_rank_gib(config, profile) -> float:
    """The predicted peak of the rank the runs' memory was measured on: world rank 0 (the
    first pipeline stage) under nanotron's count, else the busiest rank's estimate."""
    if counts_nanotron(config, profile):
        return rank_need(rank_parts(config, profile, 0), profile) / GiB
    return memory_fit(config, profile)[0]


def memory_line(profile, runs) -> str:
    """The median |predicted / measured - 1| of the memory, per model, over the runs that ran."""
    errors = defaultdict(list)
    for row, config in runs:
        if row["status"] == "ran":
            measured = float(row["measured_mem_gb"])
            errors[row["model"]].append(abs(measured_rank_gib(config, profile) / measured - 1))
    return "  memory, median |p/m-1| of the measured rank's peak: " + ", ".join(
        f"{model} {np.median(e):.3f}" for model, e in sorted(errors.items()))


def fit_time(profile, runs, max_evals) -> dict:
    """The time numbers of FREE that minimise the robust log error on the runs that ran."""
    from scipy.optimize import least_squares
    ran = [r for r in runs if r[0]["status"] == "ran"]
    measured = np.array([float(row["measured_tok_s_gpu"]) for row, _ in ran])
    size = defaultdict(int)
    for row, _ in ran:
        size[(row["model"], row["nodes"])] += 1
    weight = np.array([1 / size[(row["model"], row["nodes"])] for row, _ in ran])
    to_z = [(math.log if lg else float) for _, _, lg in FREE.values()]
    from_z = [(math.exp if lg else float) for _, _, lg in FREE.values()]

    def numbers(z):
        return {k: f(v) for k, f, v in zip(FREE, from_z, z)}

    def residuals(z):
        """sqrt(weight x cauchy(log error)): the squares sum to each cell's robust loss with
        the cells alike (least_squares' own loss would scale the weights into its f_scale)"""
        p = profile.with_numbers(**numbers(z))
        error = np.log(np.array([q.tok_s_gpu for q in predictions(p, ran)]) / measured)
        return np.sqrt(weight * SCALE ** 2 * np.log1p((error / SCALE) ** 2))

    low = [f(lo) for f, (lo, _, _) in zip(to_z, FREE.values())]
    high = [f(hi) for f, (_, hi, _) in zip(to_z, FREE.values())]
    best = None
    for link in LINK_STARTS:
        begin = dict(START, inter_bytes_per_s=link)
        start = np.clip([f(min(max(begin[k], lo), hi)) for f, k, (lo, hi, _) in
                         zip(to_z, FREE, FREE.values())], low, high)
        result = least_squares(residuals, start, bounds=(low, high), max_nfev=max_evals,
                               diff_step=0.05)
        if best is None or result.cost < best.cost:
            best = result
    return numbers(best.x)


def subsample(runs, per_cell):
    """Up to `per_cell` rows of each (model, nodes) cell, evenly spread."""
    cells = defaultdict(list)
    for r in runs:
        cells[(r[0]["model"], int(r[0]["nodes"]))].append(r)
    out = []
    for rows in cells.values():
        step = max(1, len(rows) // per_cell)
        out += rows[::step][:per_cell]
    return out


def fit_over_memory(profile, runs) -> float:
    """over_memory_speed: the median measured / predicted speed of the runs that ran though
    `profile` predicts they do not fit (their prediction taken at full speed), or 1 where
    fewer than MIN_PAST_MEMORY such runs tell it."""
    at_full = profile.with_numbers(over_memory_speed=1.0)
    ran = [r for r in runs if r[0]["status"] == "ran"]
    shares = [float(row["measured_tok_s_gpu"]) / q.tok_s_gpu
              for (row, _), q in zip(ran, predictions(at_full, ran)) if not q.fits]
    return float(np.median(shares)) if len(shares) >= MIN_PAST_MEMORY else 1.0


def fit(profile, runs, per_cell, max_evals) -> dict:
    memory = fit_memory(profile, runs)
    timed = fit_time(profile.with_numbers(**memory, over_memory_speed=1.0),
                     subsample(runs, per_cell), max_evals)
    over = fit_over_memory(profile.with_numbers(**memory, **timed), runs)
    return {**memory, **timed, "over_memory_speed": over}


def numbers_line(name, numbers) -> str:
    return f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in numbers.items())


def write_profile(numbers: dict, when: str):
    """The fit's values into playbook-h100.json, each number's line kept but its value."""
    path = os.path.join(HERE, "playbook-h100.json")
    with open(path) as f:
        text = f.read()
    for key, value in numbers.items():
        text, n = re.subn(rf'("{key}": {{"value": )[^,]+', rf"\g<1>{value:.4g}", text)
        assert n == 1, key
    json.loads(text)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(path, ROOT)} ({when})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--per_cell", type=int, default=30,
                        help="rows of each (model, nodes) cell the time fit uses")
    parser.add_argument("--max_evals", type=int, default=60,
                        help="evaluations of the time fit's least squares")
    parser.add_argument("--quick", action="store_true",
                        help="the in-sample fit only, no leave-one-model-out")
    parser.add_argument("--write", action="store_true",
                        help="store the in-sample fit in the playbook-h100 profile")
    args = parser.parse_args()
    if importlib.util.find_spec("scipy") is None:
        raise SystemExit("bench/planner_fit.py fits with scipy: pip install scipy")
    profile = load_profile("playbook-h100")
    runs, refused = load_runs()
    when = f"{datetime.date.today()}, CPU"
    print(f"python bench/planner_fit.py --per_cell {args.per_cell} --max_evals "
          f"{args.max_evals}  ({when}; {len(runs)} rows scored, {refused} left out: refused by "
          f"the config or dp x mbs x grad_acc not their gbs)")
    shipped = {k: profile[k] for k in ("mem_logit_bytes", *MEMORY, "mem_margin", *FREE,
                                        "over_memory_speed")}
    print(numbers_line("profile as shipped", shipped))
    print("\n".join(report("as shipped", judge(profile, runs))))
    print(memory_line(profile, runs))
    both = fit(profile, runs, args.per_cell, args.max_evals)
    print(numbers_line("fit on both shapes", both))
    print("\n".join(report("in sample (fit on 1B and 8B, judged on both)",
                           judge(profile.with_numbers(**both), runs))))
    print(memory_line(profile.with_numbers(**both), runs))
    for train, test in () if args.quick else (("1B", "8B"), ("8B", "1B")):
        numbers = fit(profile, [r for r in runs if r[0]["model"] == train], args.per_cell,
                      args.max_evals)
        print(numbers_line(f"fit on {train}", numbers))
        print("\n".join(report(f"leave one model out: fit on {train}, judged on {test}", judge(
            profile.with_numbers(**numbers), [r for r in runs if r[0]["model"] == test]))))
        print(memory_line(profile.with_numbers(**numbers),
                          [r for r in runs if r[0]["model"] == test]))
    if args.write:
        write_profile(both, when)


if __name__ == "__main__":
    main()
