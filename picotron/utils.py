"""Seeding, the learning-rate schedule, FLOPs and MFU, and the metrics log."""
import json
import math
import os
import random
import sys
import time

import torch

from picotron.config import MissingPackage

# Dense bf16 peak of one GPU, FLOP/s, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H200": 989.5e12, "H100": 989.5e12, "A100": 312e12, "L40S": 362e12,
                   "A10G": 125e12, "RTX 4090": 165.2e12}


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)      # CPU and every CUDA device


def lr_at(step: int, cfg) -> float:
    """Linear warm-up to `learning_rate` over `warmup_steps`, then cosine decay to
    `learning_rate * min_lr_ratio` at `total_train_steps`. step counts from 1."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    if step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    decay_steps = max(1, cfg.total_train_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def count_params(model_cfg) -> int:
    """N: parameters of the whole model, a tied embedding/head counted once."""
    m = model_cfg
    head_dim = m.hidden_size // m.num_attention_heads
    kv = m.num_key_value_heads * head_dim
    attn = m.hidden_size * (2 * m.hidden_size + 2 * kv)
    mlp = 3 * m.hidden_size * m.intermediate_size
    norms = (1 if m.parallel_residual else 2) * m.hidden_size
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * (attn + mlp + norms) + m.hidden_size + embeddings


def flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls forward and backward, plus 12*L*C*T for
    the attention scores and their weighted sum (PaLM paper, appendix B; C = hidden size,
    T = sequence length; counted as if attention were not causal, as is customary)."""
    m = model_cfg
    return 6 * count_params(m) + 12 * m.num_hidden_layers * m.hidden_size * seq_len


def peak_flops(device) -> float:
    """Peak dense bf16 FLOP/s of this GPU, or None (CPU, or a GPU we have no number for)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


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
                last = max([step for step, _ in records if step <= keep_until_step] or [0])
                if last < keep_until_step:
                    print(f"warning: {path} holds no record of steps {last + 1}-"
                          f"{keep_until_step} (a write that failed, or the file edited); the "
                          f"resumed run writes from step {keep_until_step + 1} on",
                          file=sys.stderr, flush=True)
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


def format_step(r: dict) -> str:
    """The one readable line per step: where the run is, how it learns, how fast, and (with
    the progress fields of picotron/step_log.py) how long it has run and has left."""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    where = f"step {r['step']:>5}" + (f"/{r['total_steps']}" if "total_steps" in r else "")
    when = ""
    if "elapsed_s" in r:
        left = "" if r.get("eta_s") is None else f", {duration(r['eta_s'])} left"
        when = f" | {duration(r['elapsed_s'])}{left}"
    return (f"{where} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens']:,} tokens | "
            f"{r['tokens_per_s']:,.0f} tok/s | "
            f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu | MFU {mfu} | "
            f"mem {r['peak_mem_gb']:.1f} GB | {r['step_time_s'] * 1000:.0f} ms{when}"
            + (f" | loss scale {r['loss_scale']:g}" if "loss_scale" in r else "")
            + (" | non-finite gradient: step skipped" if r.get("skipped") else ""))


def duration(seconds: float) -> str:
    """12.3 -> '12s', 754 -> '12m34s', 7384 -> '2h03m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StepValues:
    """A step's scalars (loss, grad norm, ...), copied to the host without waiting for them.

    `loss.item()` right after queueing a step makes the host wait until the GPU has finished
    it; the GPU then idles while the host queues the next step's first kernels. Instead the
    values are stacked on the device, copied into pinned host memory behind the step's work
    (non-blocking), and `read()` later, once the next step is queued: it waits for this step
    only. Plain Python numbers pass through as they are."""

    def __init__(self, values: dict, device):
        self.names = [k for k, v in values.items() if torch.is_tensor(v)]
        self.known = {k: v for k, v in values.items() if not torch.is_tensor(v)}
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in self.names])
        self.ready = None
        if device.type == "cuda":
            self.host = torch.empty(len(self.names), pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = stacked

    def read(self) -> dict:
        if self.ready is not None:
            self.ready.synchronize()
        return {**self.known, **dict(zip(self.names, self.host.tolist()))}


def cpu_share() -> int:
    """The CPU cores this process may use: its affinity mask, capped by the cgroup's CPU
    quota (a container limited to 2 cores of a 64-core host sees 64 in os.cpu_count())."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:              # "max 100000" or "200000 100000"
            quota, period = f.read().split()
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores or 1)


def set_cpu_threads(local_processes: int) -> int:
    """One intra-op thread per core share: cores // processes on this machine. torch's
    default counts the host's cores, so N processes on a small machine (or one process in a
    container with a CPU quota) run N x cores threads that wait on each other, 2-3x slower a
    step. Returns the thread count chosen."""
    threads = max(1, cpu_share() // max(1, local_processes))
    torch.set_num_threads(threads)
    return threads
