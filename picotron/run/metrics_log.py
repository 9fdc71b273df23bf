"""metrics.jsonl, a run's record of every step, and the loggers beside it (Weights & Biases,
TensorBoard): written as strict JSON, kept across resumes, and never the reason a run stops."""
import json
import math
import os
import sys
import time

from picotron.config import MissingPackage


def import_loggers(config) -> dict:
    """{"wandb": the module, "tensorboard": its SummaryWriter} for the loggers the config turns
    on; a package that cannot be imported is refused (MissingPackage). train.py calls it on
    every rank before building anything (a large model builds for minutes, and only the
    logging rank would meet the error), MetricsLog again to use them."""
    found = {}
    if config.logging.use_wandb:
        try:
            import wandb
        except ImportError as e:
            raise MissingPackage("logging.use_wandb=true", "wandb (`pip install wandb`)",
                                 "or set it to false", e) from None
        found["wandb"] = wandb
    if config.logging.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MissingPackage("logging.tensorboard=true", "tensorboard (`pip install "
                                 "tensorboard`)", "or set it to false", e) from None
        found["tensorboard"] = SummaryWriter
    return found


def read_records(path: str):
    """metrics.jsonl's records as (step, line) pairs, and the numbers of the lines that are
    not a record (not a JSON object with an integer "step": a half-written last line)."""
    records, broken = [], []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = record["step"] if isinstance(record, dict) else None
            except (ValueError, KeyError):
                step = None
            if type(step) is int:
                records.append((step, line if line.endswith("\n") else line + "\n"))
            else:
                broken.append(number)
    return records, broken


def saturated_steps(path: str, after_step: int) -> list:
    """The records after `after_step` of the steps in which delayed FP8 saturated (a count
    of `fp8_saturated_sites`: picotron/speed/fp8/saturation.py), for the run's summary; []
    when the file cannot be read."""
    try:
        records, _ = read_records(path)
    except OSError:
        return []
    # the key is in a saturated step's line (and in fp8_saturated_before): parse only those
    found = (json.loads(line) for step, line in records
             if step > after_step and '"fp8_worst_site"' in line)
    return [record for record in found if record.get("fp8_saturated_sites")]


def step_ranges(steps: set) -> str:
    """{2, 3, 4, 9} -> '2-4, 9' ('' for none)."""
    runs, ordered = [], sorted(steps)
    for step in ordered:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def set_aside_metrics(path: str):
    """A run that starts over at step 0 in a directory whose metrics.jsonl holds records (an
    earlier run there that left no checkpoint) would truncate them: they are moved to
    metrics.jsonl.replaced-<UTC time> instead. Returns that name, or None."""
    if not os.path.isfile(path) or not read_records(path)[0]:
        return None
    stamp = f"{path}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    aside, n = stamp, 1
    while os.path.lexists(aside):             # two starts in one second: keep both
        aside, n = f"{stamp}-{n}", n + 1
    os.replace(path, aside)
    return aside


class MetricsLog:
    """Appends one JSON object per line to <run_dir>/metrics.jsonl (only on the logging rank),
    to Weights & Biases when `logging.use_wandb` is set, and to TensorBoard event files in
    <run_dir>/tensorboard/ when `logging.tensorboard` is set (every number but the step, as
    a scalar of the same name: loss, lr, grad_norm, tokens_per_s, mfu, val_loss, ...).

    Every line is strict JSON: a value that is not a finite number (a NaN loss, the infinite
    gradient norm of a skipped step) is written as null, which every JSON reader accepts,
    where Python's default `NaN` / `Infinity` are refused by most. The record's `skipped`
    says why; TensorBoard and W&B get the float itself.

    A resumed run keeps the records up to its first step (keep_until_step) and drops the
    later ones, which the run is about to write again (TensorBoard hides them likewise).

    A write that fails (a full disk, a run directory moved or deleted) warns once and turns
    that output off: the step lines still print every number, and training, which the
    records only describe, goes on to its next checkpoint."""

    def __init__(self, path: str, enabled: bool, config=None, keep_until_step: int = 0):
        self.path, self.enabled, self.wandb, self.tensorboard = path, enabled, None, None
        if enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            kept = []
            if keep_until_step and os.path.exists(path):
                records, broken = read_records(path)
                kept = [line for step, line in records if step <= keep_until_step]
                missing = step_ranges(set(range(1, keep_until_step + 1))
                                      - {step for step, _ in records})
                if missing:
                    print(f"warning: {path} holds no record of steps {missing} (a write that "
                          f"failed, or the file edited); the resumed run writes from step "
                          f"{keep_until_step + 1} on", file=sys.stderr, flush=True)
                if broken:      # a run killed while writing a line leaves half of one
                    print(f"warning: {path}: dropped {len(broken)} line(s) that are not a "
                          f"whole record (line {', '.join(map(str, broken[:5]))}; a run "
                          f"killed while writing?)", file=sys.stderr, flush=True)
            with open(path, "w") as f:
                f.writelines(kept)
        loggers = import_loggers(config) if enabled and config is not None else {}
        if "wandb" in loggers:
            self.wandb = loggers["wandb"].init(project=config.logging.project_name,
                                               name=config.logging.run_name,
                                               config=config.to_dict())
        if "tensorboard" in loggers:
            # purge_step: events of the steps a resumed run writes again are hidden
            self.tensorboard = loggers["tensorboard"](
                os.path.join(os.path.dirname(path) or ".", "tensorboard"),
                purge_step=keep_until_step + 1 if keep_until_step else None)

    def write(self, record: dict) -> None:
        if self.enabled:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
            except OSError as e:
                self._warn_stopped(self.path, e, record["step"])
                self.enabled = False
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        if self.tensorboard is not None:
            try:            # checked first: tensorboard's writer thread would print a traceback
                if not os.path.isdir(self.tensorboard.log_dir):
                    raise FileNotFoundError(f"no folder {self.tensorboard.log_dir}")
                for name, value in record.items():
                    if name != "step" and type(value) in (int, float):   # not bools or None
                        self.tensorboard.add_scalar(name, value, record["step"])
                self.tensorboard.flush()    # on disk at every step, as metrics.jsonl is
            except OSError as e:
                self._warn_stopped(self.tensorboard.log_dir, e, record["step"])
                self.tensorboard = None

    @staticmethod
    def _warn_stopped(where: str, error: OSError, step: int) -> None:
        print(f"warning: cannot write {where} at step {step} ({type(error).__name__}: "
              f"{error}); it gets no more records this run, and training goes on (the step "
              f"lines still print every number). Fix the cause (a full disk, a run directory "
              f"moved or deleted) before the next checkpoint, which would stop the run",
              file=sys.stderr, flush=True)


def finite_or_null(value):
    """`value` with every float that is not finite (NaN, +-inf) replaced by None, at any
    depth: what strict JSON can hold (it has no NaN or Infinity; None is written null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value
