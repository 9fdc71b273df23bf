"""The memory estimate (picotron/plan/memory_plan.py) against torch.cuda.max_memory_allocated on one
GPU: the SmolLM presets at seq 2048, the default fast path, a few micro-batches.

    python bench/memory_plan_check.py [--shapes SmolLM-135M,SmolLM-360M,SmolLM-1.7B]
        [--mbs 8,16,32] [--steps 3] [--set training.activation_checkpointing=full ...]

Each (shape, micro-batch) runs in a fresh process (nothing left from the row before):
train.py's build_training and `--steps` queued steps on synthetic tokens, with
torch.cuda.max_memory_allocated read from the process's start (weights, AdamW state, activations,
gradients: everything the estimate counts; max_memory_reserved under CUDA graphs, whose pool counts
as allocated only while it is captured). One line per row: the estimate, split into what is held all
step and the forward and step phases (picotron/plan/memory_plan.py says what each holds), the
measured peak, their ratio, and whether it is within the estimate's stated accuracy (15%). A row
that runs out of memory prints OOM next to its estimate.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from picotron.config import config_from_dict  # noqa: E402
from picotron.plan.memory_plan import MARGIN, GiB, estimate  # noqa: E402


def build_config(shape, mbs, seq, sets):
    """The bench's config (bench_speed.base_config: preset, bf16, fused AdamW, synthetic data,
    every speed option "auto") with the `--set section.key=value` overrides."""
    import bench_speed
    raw = bench_speed.base_config(shape, mbs, seq)
    for item in sets:
        name, value = item.split("=", 1)
        section, key = name.split(".")
        try:
            value = json.loads(value)       # numbers, true/false, null
        except ValueError:
            pass                            # a string, e.g. full
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw, world_size=1)


def phases(e):
    return {when: sum(r.bytes for r in e.rows if r.when == when) / GiB
            for when in ("held", "forward", "step")}


def child(args):
    """One row: build, run, print "RESULT {json}"."""
    import torch.distributed as dist

    import bench_speed
    import train
    from picotron.data.windows import StepBatches, SyntheticData
    from picotron.process_group_manager import ProcessGroupManager
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    train.materialize = bench_speed.cached_materialize      # the same weights, drawn once
    config = build_config(args.shapes, args.mbs_one, args.seq, args.set)
    e = estimate(config)
    result = {"estimate": e.device_bytes / GiB, **phases(e)}
    device = torch.device("cuda")
    try:
        pgm = ProcessGroupManager.from_config(config)
        model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
        data = SyntheticData(args.seq, config.model.vocab_size, 42)
        batches = StepBatches(data, config, pgm, device)
        for step in range(args.steps):
            train.queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm,
                             device)
        torch.cuda.synchronize()
        # under CUDA graphs the allocated peak counts the graphs' pool only while captured
        # (bf16 graphs: before AdamW's state exists): what the process reserved is what it held
        result["measured"] = (torch.cuda.max_memory_reserved() if config.training.cuda_graphs
                              else torch.cuda.max_memory_allocated()) / GiB
    except torch.OutOfMemoryError:
        result["measured"] = "OOM"
    print("RESULT " + json.dumps(result), flush=True)
    if args.rows:
        from picotron.plan.memory_plan import describe
        print(describe(e), flush=True)


def run_row(args, shape, mbs):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--shapes", shape,
           "--mbs", str(mbs), "--seq", str(args.seq), "--steps", str(args.steps)]
    cmd += [x for item in args.set for x in ("--set", item)] + ["--rows"] * args.rows
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        return None, proc.stderr[-1500:]
    rows = proc.stdout.split(found[0], 1)[1].strip()
    return json.loads(found[0][len("RESULT "):]), rows


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM-135M,SmolLM-360M,SmolLM-1.7B",
                   help="presets (%(default)s)")
    p.add_argument("--mbs", default="8,16,32", help="micro-batch sizes (%(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (%(default)s)")
    p.add_argument("--steps", type=int, default=3, help="training steps per row (%(default)s)")
    p.add_argument("--set", action="append", default=[],
                   help="section.key=value for every row, e.g. training.master_weights=false")
    p.add_argument("--rows", action="store_true", help="also print each estimate's rows")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.mbs_one = int(args.mbs)
        return child(args)
    print(f"{'shape':<12} {'mbs':>4} {'estimate':>9} {'(held':>6} {'fwd':>6} {'step)':>6} "
          f"{'measured':>9} {'ratio':>6}  within {MARGIN:.0%}", flush=True)
    for shape in args.shapes.split(","):
        for mbs in map(int, args.mbs.split(",")):
            result, detail = run_row(args, shape, mbs)
            if result is None:
                print(f"{shape:<12} {mbs:>4} ERROR {detail}", flush=True)
                continue
            measured = result["measured"]
            ratio = result["estimate"] / measured if measured != "OOM" else float("nan")
            shown = f"{measured:9.2f}" if measured != "OOM" else f"{'OOM':>9}"
            print(f"{shape:<12} {mbs:>4} {result['estimate']:9.2f} {result['held']:6.1f} "
                  f"{result['forward']:6.1f} {result['step']:6.1f} {shown} {ratio:6.3f}  "
                  f"{'yes' if abs(ratio - 1) <= MARGIN else 'NO'}", flush=True)
            if args.rows:
                print(detail, flush=True)


if __name__ == "__main__":
    main()
