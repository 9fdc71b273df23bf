"""train.py run as a script, with the gradient norm reported non-finite from the Nth
optimizer step on, as a diverged model's is: the optimizer then skips those steps.

    python tests/workers/diverging_run.py CONFIG N [train.py flags...]

A learning rate large enough to diverge for real is refused by the config's ranges, and an
overflow's step depends on the model; this makes the step exact. The weights and the
gradients stay real: only the norm the optimizer checks is replaced. After each optimizer
step, the sum of every parameter shard is appended to weight_sums.jsonl beside CONFIG, so a
test can see that a skipped step left the weights as they were."""
import json
import os
import runpy
import sys

from picotron.data_parallel.optimizer import DistributedAdamW

config, first_bad = sys.argv[1], int(sys.argv[2])
norm, step, calls = DistributedAdamW.global_grad_norm, DistributedAdamW.step, []
sums = os.path.join(os.path.dirname(os.path.abspath(config)), "weight_sums.jsonl")


def diverged(self):
    calls.append(1)
    return norm(self) * (float("nan") if len(calls) >= first_bad else 1.0)


def step_and_record(self, lr):
    done = step(self, lr)
    with open(sums, "a") as f:
        f.write(json.dumps([float(p.double().sum()) for p in self.param_shards]) + "\n")
    return done


DistributedAdamW.global_grad_norm, DistributedAdamW.step = diverged, step_and_record
train = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "train.py")
sys.argv = [train, "--config", config, *sys.argv[3:]]
runpy.run_path(train, run_name="__main__")
