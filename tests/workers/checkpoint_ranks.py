"""4 gloo ranks (tp=2 x pp=2): train with async and sync saves, resume, then damage copies of
the last checkpoint and record what every rank says when it loads them.

    torchrun --nproc_per_node 4 tests/workers/checkpoint_ranks.py OUT ASYNC SYNC RESUMED

Trains the three configs in order (train.main, one process group for all), then for each
damage case rank 0 damages a fresh copy, every rank tries to load it, and each rank writes
{case: what happened} to OUT/result-rank{R}.json. A rank that hung instead of refusing
would fail the launch by its timeout.
"""
import datetime
import json
import os
import shutil
import sys

import torch.distributed as dist

import train
from picotron.checkpoint.checkpoint import CheckpointError, find_checkpoint, load_checkpoint

CASES = ("rng-rank3.safetensors random bytes", "optimizer-pp1-tp1.safetensors truncated",
         "weights-pp0-tp1.safetensors deleted", "latest with the newest state.json deleted")


def damage(root: str, case: str) -> None:
    """Rank 0: damage the newest checkpoint under `root` (a copy of the run's) as `case` says."""
    newest = os.path.join(root, "step_000004")
    path = os.path.join(newest, case.split()[0])
    if case.endswith("random bytes"):
        with open(path, "wb") as f:
            f.write(os.urandom(os.path.getsize(path)))
    elif case.endswith("truncated"):
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 3])
    elif case.startswith("latest"):
        os.remove(os.path.join(newest, "state.json"))
    else:
        os.remove(path)


def main(out: str, configs: list):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for path in configs:
        train.main(["--config", path])
    config, pgm, device = train.setup(configs[0])
    model, _, _, optimizer = train.build_training(config, pgm, device)
    run_dir = os.path.dirname(configs[0])
    results = {}
    for i, case in enumerate(CASES):
        root = os.path.join(out, f"case{i}", "checkpoints")
        newest = os.path.join(root, "step_000004")
        if pgm.global_rank == 0:
            shutil.copytree(os.path.join(run_dir, "checkpoints"), root)
            damage(root, case)
        dist.barrier()
        try:
            if case.startswith("latest"):
                newest = find_checkpoint("latest", root, run_dir, pgm)[0]
            load_checkpoint(newest, model, optimizer, pgm, config)
            results[case] = f"loaded {os.path.basename(newest)}"
        except CheckpointError as e:
            results[case] = str(e)
    with open(os.path.join(out, f"result-rank{pgm.global_rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
