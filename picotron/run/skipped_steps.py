"""Steps the optimizer skipped, and what a run does about them.

A step whose gradient norm is not finite (a diverged model; a float16 overflow; a loss that is
NaN, whose gradient always is) is skipped: the weights stay as they were. One skip now and then
is float16's loss scale at work (each skip halves it, and the next step trains); a streak of
them is a model that no longer trains, and the weights of its last trained step may be what
broke it (finite weights whose float16 forward overflows: every loss after them is NaN). So:

- no checkpoint is written while the run skips (the step just finished was skipped): the save
  is left out with one line, and `latest` keeps naming the last checkpoint written before the
  skips began, as for weights that are not finite (picotron/checkpoint/write.py);
- `training.max_skipped_steps` skipped in a row stop the run (status 2);
- a run that reaches its last step while skipping, with its last `STREAK_AT_END` steps all
  skipped or its last loss not finite, ends with status 2 too, instead of "done".
Each says the steps and the last checkpoint written before them, the place to resume from.
When the loss of the streak's first step is already not finite, the update of the step before
it broke the weights, and a checkpoint that step wrote holds them: the place to resume from is
the one before, and `latest` is pointed back at it. Every rank decides alike: the gradient norm
that decides a skip is global, and the losses (held by the last pipeline stage) are shared
when a rule fires.
"""
import math
import os

import torch
import torch.distributed as dist

from picotron.checkpoint.verify import latest_written
from picotron.checkpoint.write import atomic_write
from picotron.errors import RunStopped
from picotron.run.divergence import last_checkpoint_before

# skipped steps in a row at the end that fail a run whose last loss is finite: float16's
# loss scale, doubled past its level, overflows once and halves (one skip), rarely twice
STREAK_AT_END = 3


class SkippedSteps:
    """skips = SkippedSteps(config.training, save_dir); after each logged step
    `skips.update(step, skipped, loss, grad_norm, device)` (raises RunStopped at
    max_skipped_steps in a row); before a save, `skips.skipping` (then `skips.leave_out(...)`);
    at the end of the loop, `skips.check_end(device)`."""

    def __init__(self, training, save_dir):
        self.limit, self.learning_rate = training.max_skipped_steps, training.learning_rate
        self.float16, self.save_dir = training.dtype == "float16", save_dir
        self.total = 0                      # skipped steps of this launch
        self.first, self.last = None, None  # the streak going on: its first and last step
        self.losses = (None, None)          # the loss of its first step, of the last step

    @property
    def in_a_row(self) -> int:
        return 0 if self.first is None else self.last - self.first + 1

    @property
    def skipping(self) -> bool:
        """Whether the step just logged was skipped."""
        return self.first is not None

    def update(self, step: int, skipped: bool, loss: float, grad_norm, device) -> None:
        if not skipped:
            self.first = self.last = None
            return
        self.total += 1
        if self.first is None:
            self.first, self.losses = step, (loss, loss)
        self.last, self.losses = step, (self.losses[0], loss)
        if self.limit and self.in_a_row >= self.limit:
            first_bad, _ = self._losses_not_finite(device)
            raise RunStopped(
                f"the last {self.in_a_row} steps (to step {step}) were all skipped for a "
                f"non-finite gradient (grad norm {grad_norm}): the model no longer trains. "
                f"{self._resume(first_bad)}. training.max_skipped_steps={self.limit} sets how "
                f"many skipped steps in a row stop a run (0: never)")

    def leave_out(self, directory: str, speak: bool) -> str:
        """The save of `directory` is not made while skipping: said once (`speak`); returns
        why, for the run's last line."""
        if speak:
            latest = latest_written(self.save_dir)
            print(f"warning: not saving {directory}: {self._steps()} skipped for a non-finite "
                  f"gradient, and a checkpoint written after the skips began is no place to "
                  f"resume; `latest` stays "
                  f"{latest + ', written before them' if latest else 'unset'}", flush=True)
        return f"step {self.last} was skipped"

    def check_end(self, device) -> None:
        """At the end of the loop, on every rank (collective when the last step was skipped,
        which every rank knows alike): a run whose last STREAK_AT_END steps were skipped, or
        whose last step was skipped with a loss that is not finite, raises RunStopped."""
        if not self.skipping:
            return
        first_bad, last_bad = self._losses_not_finite(device)
        if self.in_a_row < STREAK_AT_END and not last_bad:
            return
        loss = "its last loss is not finite" if last_bad else "its last loss is finite"
        raise RunStopped(
            f"the run ended while skipping: {self._steps()} skipped for a non-finite gradient "
            f"and {loss}; its weights did not train after step {self.first - 1}. "
            f"{self._resume(first_bad)}")

    def _losses_not_finite(self, device) -> tuple:
        """Collective: (the streak's first loss, the last loss) not finite on any rank."""
        bad = torch.tensor([float(x is not None and not math.isfinite(x))
                            for x in self.losses], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)      # the last stage holds the loss
        return bool(bad[0]), bool(bad[1])

    def _steps(self) -> str:
        if self.in_a_row == 1:
            return f"step {self.last} was"
        return f"steps {self.first}-{self.last} ({self.in_a_row} in a row) were"

    def _resume(self, first_bad: bool) -> str:
        """Where to resume from, and what to change. `first_bad`: the streak's first loss is
        not finite (the step before it broke the weights): `latest` is pointed back before."""
        broke = self.first - 1
        good = last_checkpoint_before(self.save_dir, broke if first_bad else self.first)
        latest = latest_written(self.save_dir)
        before = (f"written before step {broke}, whose update made every loss after it "
                  f"non-finite" if first_bad else "written before them")
        resume = ", then resume with --set checkpoint.load_path=latest"
        if good is None:
            which, resume = f"No checkpoint was {before}", ", and start again"
        elif latest == os.path.basename(good):
            which = f"The last checkpoint {before}: {good} (`latest` names it)"
        elif first_bad and (dist.get_rank() if dist.is_initialized() else 0) == 0:
            atomic_write(os.path.join(self.save_dir, "latest"), os.path.basename(good) + "\n")
            which = f"The last checkpoint {before}: {good} (`latest` now names it, not {latest})"
        else:
            which = f"The last checkpoint {before}: {good}"
            resume = f", then resume from it (--set checkpoint.load_path={good})"
        dtype = ", or with float16 use bfloat16" if self.float16 else ""
        return (f"{which}. Lower training.learning_rate (now {self.learning_rate:g})"
                f"{dtype}{resume}")
