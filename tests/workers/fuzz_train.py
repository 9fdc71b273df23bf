"""Train each config file for one step, in order, in this one process; report each outcome.

    python tests/workers/fuzz_train.py CONFIG [CONFIG ...]

Used by tests/test_config_fuzz.py, which starts it, reads its reports and kills it when a case
runs past its time. For each config it prints one line `FUZZ {"index", "outcome", "detail"}`:
"trained" (train.main returned and logged step 1 with a finite loss), "refused" (one of the
errors the entry points print without a traceback) or "crash" (anything else, with the
traceback). The interpreter and torch start once for all cases; the stdlib corpus is read once.
"""
import functools
import json
import math
import os
import resource
import sys
import traceback

import torch.distributed as dist

import picotron.data.windows
import train
from picotron.checkpoint.checkpoint import CheckpointError
from picotron.config import ConfigError, MissingPackage, load_config
from picotron.data.windows import DataError
from picotron.errors import RunStopped

CLEAN = (ConfigError, MissingPackage, DataError, CheckpointError, RunStopped)
ONE_STEP = "training.total_train_steps=1"      # every case that loads trains one step
MEMORY_LIMIT = 8 * 2 ** 30    # a size the checks let through fails here, not on the machine


def report(index: int, outcome: str, detail: str = "") -> None:
    print("FUZZ " + json.dumps({"index": index, "outcome": outcome, "detail": detail}),
          flush=True)


def first_loss(path: str):
    """The loss of step 1 in the run's metrics.jsonl, or None when there is none."""
    config = load_config(path, overrides=[ONE_STEP])
    run_dir = config.logging.run_dir or os.path.dirname(os.path.abspath(path))
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics):
        return None
    records = [json.loads(line) for line in open(metrics) if line.strip()]
    return next((r["loss"] for r in records if r.get("step") == 1 and "loss" in r), None)


def run_case(index: int, path: str) -> None:
    try:
        train.main(["--config", path, "--set", ONE_STEP])
    except CLEAN as e:
        report(index, "refused", f"{type(e).__name__}: {e}")
        return
    except BaseException:        # SystemExit and KeyboardInterrupt included: none should come
        report(index, "crash", traceback.format_exc())
        return
    finally:
        if dist.is_initialized():          # a failed run leaves its one-process group
            dist.destroy_process_group()
    loss = first_loss(path)
    if loss is None or not math.isfinite(loss):
        report(index, "crash", f"trained, but the loss of step 1 is {loss}")
    else:
        report(index, "trained")


def main(paths: list) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    windows = picotron.data.windows
    windows.embedded_corpus_bytes = functools.lru_cache(windows.embedded_corpus_bytes)
    for index, path in enumerate(paths):
        print(f"FUZZ-START {index}", flush=True)
        run_case(index, path)


if __name__ == "__main__":
    main(sys.argv[1:])
