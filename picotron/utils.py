"""Seeding, the learning-rate schedule, FLOPs and MFU, the step line, CPU threads; a file's
sha256 and the mode a written file gets (checkpoints and the token cache use both)."""
import hashlib
import math
import os
import random

import torch

# Dense bf16 peak of one GPU, FLOP/s, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H200": 989.5e12, "H100": 989.5e12, "A100": 312e12, "L40S": 362e12,
                   "A10G": 125e12, "RTX 4090": 165.2e12}


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)      # CPU and every CUDA device


# The training settings lr_at reads, and how a resume line writes each one when a resume
# changes it (picotron/checkpoint/changes.py: a new schedule is said, not refused).
SCHEDULE_SETTINGS = {"total_train_steps": "{} steps", "warmup_steps": "warmup_steps {}",
                     "learning_rate": "learning_rate {:.2e}", "min_lr_ratio": "min_lr_ratio {:g}"}


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


def format_step(r: dict, on_cpu: bool = False) -> str:
    """The one readable line per step: where the run is, how it learns, how fast, and (with
    the progress fields of picotron/run/step_log.py) how long it has run and has left.
    `on_cpu`: throughput per process, and no MFU (a CPU has no peak rate to divide by)."""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    speed = (f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/process" if on_cpu else
             f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu | MFU {mfu}")
    where = f"step {r['step']:>5}" + (f"/{r['total_steps']}" if "total_steps" in r else "")
    when = ""
    if "elapsed_s" in r:
        left = "" if r.get("eta_s") is None else f", {duration(r['eta_s'])} left"
        when = f" | {duration(r['elapsed_s'])}{left}"
    # delayed FP8 (picotron/speed/fp8/saturation.py): the sites whose tensors outgrew their
    # scales this step, and at the first non-finite loss, what the step before it saturated
    def saturated(at: dict) -> str:
        if not at["fp8_saturated_sites"]:
            return "no FP8 site saturated"
        ratio = at["fp8_worst_ratio"]
        worst = f"{ratio:,.1f}x" if ratio is not None and math.isfinite(ratio) else "non-finite"
        return (f"FP8 saturated at {plural(at['fp8_saturated_sites'], 'site')}, worst {worst} "
                f"at {at['fp8_worst_site']}")
    fp8 = f" | {saturated(r)}" if r.get("fp8_saturated_sites") else ""
    if "fp8_saturated_before" in r:
        before = r["fp8_saturated_before"]
        fp8 += f" | loss non-finite; at step {before['step']}: {saturated(before)}"
    return (f"{where} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens']:,} tokens | "
            f"{r['tokens_per_s']:,.0f} tok/s | "
            f"{speed} | "
            f"mem {r['peak_mem_gb']:.1f} GB | {r['step_time_s'] * 1000:.0f} ms{when}"
            + (f" | loss scale {r['loss_scale']:g}" if "loss_scale" in r else "")
            + (" | non-finite gradient: step skipped" if r.get("skipped") else "") + fp8)


def process_age():
    """Seconds since this process started, or None where /proc does not say (not Linux): the
    time its imports took, on a small machine with many ranks most of a slow start."""
    try:
        with open("/proc/self/stat") as f:     # field 22, after the ")" that ends the name
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def plural(count: int, noun: str) -> str:
    """1 -> '1 GPU', 8 -> '8 GPUs'; nouns ending in s take -es ('2 CPU processes')."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


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


def cpu_threads(local_processes: int, cores: int = None) -> int:
    """The intra-op threads of each of `local_processes` CPU processes: one per core share,
    cores // processes, at least one. torch's default counts the host's cores, so N
    processes on a small machine run N x cores threads that wait on each other, 2-3x slower a
    step. The cores are rarely all free (a browser, an IDE, other jobs), and a pool meets at a
    barrier at every operation: train.py and generate.py set OpenMP's passive wait, so that a
    thread sharing its core with another program is waited for asleep, not spinning. On 2
    cores with one kept busy the quick start then took 1.2 s a step with 2 threads where the
    spinning pool took 4.1-5.3 s and one thread 0.9-2.8 s (bench/NOTES.md, "CPU threads").
    `cores`: cpu_share() unless given."""
    cores = cpu_share() if cores is None else cores
    return max(1, cores // max(1, local_processes))


def set_cpu_threads(local_processes: int, threads: int = None) -> int:
    """Set this process's intra-op threads: `threads` where given (distributed.cpu_threads),
    else the policy above. Returns the thread count chosen."""
    threads = threads or cpu_threads(local_processes)
    torch.set_num_threads(threads)
    return threads


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# read once, at import: os.umask can only be read by setting it, which a background writer
# (checkpoint/async_save.py) creating a file at that moment would see
UMASK = os.umask(0o022)
os.umask(UMASK)


def readable_as_usual(path: str) -> None:
    """safetensors creates its files 0600, readable by their owner only; give them the mode
    any other file gets here (0666 less the umask), so that a team sharing a cluster's disk
    reads checkpoints and exports as it reads the logs beside them."""
    try:
        os.chmod(path, 0o666 & ~UMASK)
    except OSError:             # a file system without modes (some network mounts): as it is
        pass


def process_gone(pid: int) -> bool:
    """True when process `pid` (on this machine) has exited, a zombie included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return False
