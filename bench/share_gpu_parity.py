"""Every layout on one GPU against one process, in one call: the table of
tests/test_share_gpu_gpu.py's runs (distributed.share_gpu; what each tolerance is, and why,
is written there).

    python bench/share_gpu_parity.py [--only dp2,tp2] [--out DIR]

Trains every layout of that file 10 steps with all its ranks on cuda:0 (over gloo), and the
one-process runs it is compared with, then prints one row per layout: the largest loss,
grad-norm and weight differences against one process, each with its tolerance. The same rows
go to DIR/share_gpu_parity.md. Exits 1 when a row fails.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import test_share_gpu_gpu as suite  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--out", default=os.environ.get("OUT", "share_gpu_out"),
                   help="folder of share_gpu_parity.md (default: $OUT, else share_gpu_out)")
    p.add_argument("--runs", default=os.path.join(tempfile.gettempdir(), "share_gpu_runs"),
                   help="folder of the runs' configs, metrics and checkpoints (default: "
                   "%(default)s)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/share_gpu_parity.py needs a CUDA GPU")
    only = set(filter(None, args.only.split(",")))
    layouts = [lay for lay in suite.LAYOUTS if not only or lay[0] in only]
    runs = args.runs
    shutil.rmtree(runs, ignore_errors=True)
    os.makedirs(runs)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    rows = suite.run_suite(runs, layouts)
    text = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: {len(rows)} layouts "
            f"in {time.perf_counter() - started:.0f} s\n\n" + suite.table(rows))
    print(text, flush=True)
    with open(os.path.join(args.out, "share_gpu_parity.md"), "w") as f:
        f.write(text + "\n")
    sys.exit(0 if all(map(suite.passed, rows)) else 1)


if __name__ == "__main__":
    main()
