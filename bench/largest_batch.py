"""The largest micro-batch that fits on one GPU, with and without full
activation checkpointing, for our path and for Hugging Face + Liger.

    python bench/largest_batch.py [--shapes SmolLM-360M,SmolLM-1.7B]
                                  [--rows "ours triton,hf+liger"] [--limit 256] [--out DIR]
                                  [--modes own,full]

"own" is the row's own checkpointing: "selective" for a "... selective" row, else none.

The rows, models, data and optimizers are bench_speed.py's (seq 2048, bf16 parameters, fused
AdamW). "Fits" means two whole training steps (forward, backward, optimizer) run without an
out-of-memory error. The search: micro-batch 16, 32, 64, ... while they fit (up to --limit),
then steps of 8 between the last that fit and the first that did not. So the answer is exact
to 8 sequences, and each row's peak memory at that size is printed with it.

`bench_speed.py --largest_batch LABELS` runs the same search after its table.

Each row runs in its own process, bench/batch_fits.py (liger's patch of HF's Llama stays in
its process), and tries its sizes one after another in that process: a 1.7B build and two
steps take seconds, a fresh process per size ~30 s. After a failed size every reference is
dropped and the cache emptied; if the allocated memory does not return to within 0.5 GB of
where it started (cuBLAS and cuDNN keep their workspaces), later sizes could fail for the wrong
reason, so the search stops and says so. Output: stdout and DIR/largest_batch.txt.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

# each row's search runs in bench/batch_fits.py, in a process of its own
BATCH_FITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batch_fits.py")


def report(shapes, rows, seq, limit, emit, modes="own,full"):
    """Search every (shape, row), each row in its own process; one line per result."""
    emit(f"largest micro-batch that runs two steps (16, 32, ... up to {limit}, then steps of "
         f"8), seq {seq}, bf16 params, fused AdamW")
    for shape in shapes.split(","):
        for label in rows.split(","):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, BATCH_FITS, "--one", label,
                                   "--shapes", shape, "--seq", str(seq), "--limit", str(limit),
                                   "--modes", modes],
                                  capture_output=True, text=True)
            found = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not found:
                emit(f"{shape} {label}: CRASH rc={proc.returncode} {proc.stderr.strip()[-300:]}")
                continue
            for ckpt, (best, peak, tried) in json.loads(found[-1][7:]).items():
                peak_text = f"{peak:.1f} GB" if peak is not None else "-"
                emit(f"{shape:12s} {label:12s} checkpointing={ckpt:9s} largest micro-batch "
                     f"{best} (peak {peak_text}); tried {', '.join(tried)}")
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM-360M,SmolLM-1.7B",
                   help="model presets, comma-separated (default: %(default)s)")
    p.add_argument("--rows", default="ours triton,hf+liger", help="bench_speed.py's row "
                   "labels, comma-separated (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--limit", type=int, default=256,
                   help="largest micro-batch tried (default: 256)")
    p.add_argument("--modes", default="own,full", help="activation checkpointing modes to "
                   "search: 'own' (the row's: selective for a '... selective' row, else "
                   "none), 'none', 'selective', 'full' (default: own,full)")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder of largest_batch.txt (default: $OUT, else the current folder)")
    args = p.parse_args()
    lines = [f"torch {torch.__version__}"]

    def emit(text):
        print(text, flush=True)
        lines.append(text)
    report(args.shapes, args.rows, args.seq, args.limit, emit, args.modes)
    with open(os.path.join(args.out, "largest_batch.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
