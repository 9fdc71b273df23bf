"""Every layout on one GPU against one process, in one call: the table of
tests/test_share_gpu_gpu.py's runs (distributed.share_gpu; what each tolerance is, and why,
is written there).

    python bench/share_gpu_parity.py [--only dp2,tp2] [--set KEY=VALUE ...] [--tag T]
        [--out DIR] [--cpu]

Trains every layout of that file 10 steps with all its ranks on cuda:0 (over gloo), and the
one-process runs it is compared with, then prints one row per layout: the largest loss,
grad-norm and weight differences against one process, each with its tolerance. The same rows
go to DIR/share_gpu_parity[-T].md, and every step's loss and grad norm of each layout and of
its one-process runs to DIR/share_gpu_steps[-T].json (at step 1 all start from the same
weights, so there the difference is the gradient's rounding alone; later steps add the
weights' drift). `--cpu` runs the same suite on CPU processes over gloo, without FP8 and
CUDA graphs (the criterion tried where no GPU is: the kernels are the readable ones, so it
proves nothing about the GPU's). `--set` adds a setting to every run, layouts and references alike (e.g.
`--set training.dtype=float32`: the same layouts without bf16's rounding). Exits 1 when a row
fails.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import test_share_gpu_gpu as suite  # noqa: E402
from launch import read_metrics  # noqa: E402


def steps(path: str) -> list:
    """[[step, loss, grad norm]] of a finished run."""
    return [[r["step"], r["loss"], r["grad_norm"]] for r in read_metrics(path) if "loss" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every run, layouts and one-process runs (repeatable)")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--out", default=os.environ.get("OUT", "share_gpu_out"),
                   help="folder of the outputs (default: $OUT, else share_gpu_out)")
    p.add_argument("--runs", default=os.path.join(tempfile.gettempdir(), "share_gpu_runs"),
                   help="folder of the runs' configs, metrics and checkpoints (default: "
                   "%(default)s)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU processes over gloo, the layouts without FP8 or CUDA graphs")
    args = p.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("error: bench/share_gpu_parity.py needs a CUDA GPU (--cpu runs the suite on "
                 "CPU processes)")
    only = set(filter(None, args.only.split(",")))
    unknown = only - {lay[0] for lay in suite.LAYOUTS}
    if unknown:
        sys.exit(f"error: --only names no layout {sorted(unknown)}; the layouts are "
                 f"{[lay[0] for lay in suite.LAYOUTS]}")
    extra = [f for kv in args.settings for f in ("--set", kv)]
    gpu_only = ("training.fp8", "training.cuda_graphs")
    layouts = [lay[:6] + (lay[6] + extra,) for lay in suite.LAYOUTS
               if (not only or lay[0] in only)
               and not (args.cpu and any(f.startswith(gpu_only) for f in lay[6]))]
    runs = args.runs
    shutil.rmtree(runs, ignore_errors=True)
    os.makedirs(runs)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    rows = suite.run_suite(runs, layouts, on_cpu=args.cpu)
    settings = f" (every run: {' '.join(args.settings)})" if args.settings else ""
    device = "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(0)
    text = (f"{device}, torch {torch.__version__}: {len(rows)} layouts "
            f"in {time.perf_counter() - started:.0f} s{settings}\n\n" + suite.table(rows))
    print(text, flush=True)
    tag = f"-{args.tag}" if args.tag else ""
    with open(os.path.join(args.out, f"share_gpu_parity{tag}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, f"share_gpu_steps{tag}.json"), "w") as f:
        json.dump({row["name"]: {k: steps(path) for k, path in row["paths"].items()
                                 if not row["error"]} for row in rows}, f)
    sys.exit(0 if all(map(suite.passed, rows)) else 1)


if __name__ == "__main__":
    main()
