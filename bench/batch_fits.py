"""The child process of bench/largest_batch.py: for one row and shape, the largest micro-batch
that runs two training steps, for each checkpointing mode asked for.

    python bench/batch_fits.py --one LABEL --shapes SHAPE --seq 2048 --limit 256 --modes own,full

Prints one line "RESULT {mode: [best, peak GB, sizes tried]}" for largest_batch.py to read.
It lives apart from largest_batch.py because it builds the rows through bench_speed.py, and
bench_speed.py imports largest_batch.py (for --largest_batch): kept together, the two bench
scripts would import each other.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_speed  # noqa: E402


def fits(label, shape, mbs, seq, ckpt):
    """(True, peak GB) if two steps at this micro-batch run, else (False, why)."""
    start = torch.cuda.memory_allocated()
    r = bench_speed.measure(bench_speed.maker(label, shape, mbs, seq, ckpt), 1, 1, mbs, seq)
    # cuBLAS/cuDNN keep workspaces (tens of MB) from the first trial on: allowed; a step of 8
    # sequences moves the peak by GBs, so 0.5 GB left over cannot change an answer
    leftover = (torch.cuda.memory_allocated() - start) / 2 ** 30
    if leftover > 0.5:
        raise RuntimeError(f"{leftover:.2f} GB still allocated after micro-batch {mbs}: "
                           f"the sizes after it would not be measured fairly")
    return (True, r[1]) if isinstance(r, tuple) else (False, r)


def search(label, shape, seq, ckpt, limit):
    """The largest fitting micro-batch (16, 32, ... then steps of 8), its peak GB, and a log of
    every size tried."""
    tried, best, peak, first_fail = [], None, None, None
    mbs = 16
    while mbs <= limit:
        ok, info = fits(label, shape, mbs, seq, ckpt)
        tried.append(f"{mbs}:{'ok %.1f GB' % info if ok else info[:40]}")
        if not ok:
            first_fail = mbs
            break
        best, peak, mbs = mbs, info, mbs * 2
    if best is not None and first_fail is not None:
        for mbs in range(best + 8, first_fail, 8):
            ok, info = fits(label, shape, mbs, seq, ckpt)
            tried.append(f"{mbs}:{'ok %.1f GB' % info if ok else info[:40]}")
            if not ok:
                break
            best, peak = mbs, info
    return best, peak, tried


def child(args):
    import torch.distributed as dist

    import train
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    train.materialize = bench_speed.cached_materialize
    results = {}
    own = "selective" if "selective" in args.one else "none"      # the row's own mode
    for ckpt in args.modes.split(","):
        ckpt = own if ckpt == "own" else ckpt
        results[ckpt] = search(args.one, args.shapes, args.seq, ckpt, args.limit)
    print("RESULT " + json.dumps(results))


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", required=True, help="the row to search: a label of "
                   "bench_speed.py's rows, e.g. 'ours triton' or 'hf+liger'")
    p.add_argument("--shapes", required=True, help="one model preset, e.g. SmolLM-360M")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--limit", type=int, default=256,
                   help="largest micro-batch tried (default: 256)")
    p.add_argument("--modes", default="own,full", help="activation checkpointing modes to "
                   "search, comma-separated: own (the row's), none, selective, full "
                   "(default: own,full)")
    child(p.parse_args())


if __name__ == "__main__":
    main()
