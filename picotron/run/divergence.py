"""A run whose loss has left its best far behind stops, instead of spending its budget.

The rule: the mean loss of the last `training.divergence_steps` logged steps (20) is above
`training.divergence_factor` (3) times the best loss of this launch. A mean, so that a
diverged run's dips do not reset a count, and a healthy run's spikes are averaged out.
Measured over tiny runs at learning rates from 3e-4 to 0.1 (`python bench/divergence_rule.py`,
bench/NOTES.md "Divergence"): the mean never exceeded 1.51x the best (the early steps, whose
loss falls faster than the mean follows); lr 0.3 spiked to 4.2x for 3 steps and recovered, its
mean peaking at 2.43x; lr 1 went above 3x at step 4 and stayed there 103 steps in a row (up
to 25x), and the rule stops it at step 20, the first full window.
Non-finite losses are left out of the mean: their gradients are non-finite too, so their
steps are skipped, and `training.max_skipped_steps` (picotron/run/step_log.py) stops a run
that only skips; this rule catches the run that trains on, finite and useless.

The ranks that hold the loss (the last pipeline stage) see it; they ask every rank to stop
after the same step through the watchdog (picotron/run/watchdog.py). The message names the
step the window began and the newest checkpoint saved before it: a checkpoint saved while the
loss was already up is no place to resume.
"""
import collections
import math
import os

from picotron.checkpoint.find import complete_checkpoints


class DivergenceCheck:
    """check = DivergenceCheck(config.training, save_dir); after each logged step:
    `message = check.update(step, loss)`: None, or the message to stop with (once)."""

    def __init__(self, training, save_dir):
        self.factor, self.steps = training.divergence_factor, training.divergence_steps
        self.learning_rate, self.save_dir = training.learning_rate, save_dir
        self.best, self.best_step = math.inf, None
        self.window = collections.deque(maxlen=self.steps)     # (step, loss), finite only
        self.said = False

    def update(self, step: int, loss: float):
        if not self.factor or self.said or not math.isfinite(loss):
            return None
        if loss < self.best:
            self.best, self.best_step = loss, step
        self.window.append((step, loss))
        mean = sum(x for _, x in self.window) / len(self.window)
        if len(self.window) < self.steps or mean <= self.factor * self.best:
            return None
        self.said = True
        return self.message(step, mean)

    def message(self, step: int, mean: float) -> str:
        first = self.window[0][0]
        good = last_checkpoint_before(self.save_dir, first)
        where = (f"resume from {good}, the newest checkpoint before that window (--set "
                 f"checkpoint.load_path={good})" if good else
                 "no checkpoint was saved before it: start again")
        return (f"the loss diverged: its mean over steps {first}-{step} is {mean:.4g}, above "
                f"{self.factor:g}x its best ({self.best:.4f} at step {self.best_step}). Lower "
                f"training.learning_rate (now {self.learning_rate:g}) and {where}. "
                f"training.divergence_factor and divergence_steps set this rule (factor 0: "
                f"never)")


def last_checkpoint_before(save_dir, first: int):
    """The newest complete checkpoint under `save_dir` of a step before `first`, or None."""
    if save_dir is None:
        return None
    before = [d for d in complete_checkpoints(save_dir)
              if int(os.path.basename(d).split("_")[1]) < first]
    return before[-1] if before else None
