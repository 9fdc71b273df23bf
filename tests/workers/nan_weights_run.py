"""train.py run as a script, with one weight set to NaN after optimizer step N, as a model
whose update overflowed: the weights themselves are then non-finite, which no skipped step
can undo.

    python tests/workers/nan_weights_run.py CONFIG N MODE [train.py flags...]

MODE "save": the run goes on to its next checkpoint (make N a save's step: the steps after
N are skipped, their loss NaN, and a skipped step is never saved); "sigterm": the process also
sends itself SIGTERM during step N, so it stops after step N and saves it."""
import os
import runpy
import signal
import sys
import time

import torch

from picotron.data_parallel.optimizer import DistributedAdamW
from picotron.run import watchdog

config, bad_step, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
step, calls = DistributedAdamW.step, []


def poisoned(self, lr):
    out = step(self, lr)
    calls.append(1)
    if len(calls) == bad_step:
        with torch.no_grad():
            next(p for b in self.grads.buckets for p in b.members).fill_(float("nan"))
        if mode == "sigterm":        # heard by the watchdog's thread within the step
            os.kill(os.getpid(), signal.SIGTERM)
            end = time.time() + 30
            while watchdog._running.stop is None and time.time() < end:
                time.sleep(0.01)
    return out


DistributedAdamW.step = poisoned
train = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "train.py")
sys.argv = [train, "--config", config, *sys.argv[4:]]
runpy.run_path(train, run_name="__main__")
