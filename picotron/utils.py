"""Seeding, the learning-rate schedule, FLOPs and MFU, and the metrics log."""
import json
import math
import os
import random

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


class MetricsLog:
    """Appends one JSON object per line to <run_dir>/metrics.jsonl (only on the logging rank),
    and to Weights & Biases when `logging.use_wandb` is set.

    A resumed run keeps the records up to its first step (keep_until_step) and drops the
    later ones, which the run is about to write again."""

    def __init__(self, path: str, enabled: bool, config=None, keep_until_step: int = 0):
        self.path, self.enabled, self.wandb = path, enabled, None
        if enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            kept = []
            if keep_until_step and os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip()
                            and json.loads(line)["step"] <= keep_until_step]
            with open(path, "w") as f:
                f.writelines(kept)
        if enabled and config is not None and config.logging.use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise MissingPackage("logging.use_wandb=true", "wandb (`pip install wandb`)",
                                     "or set it to false", e) from None
            self.wandb = wandb.init(project=config.logging.project_name,
                                    name=config.logging.run_name, config=config.to_dict())

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])


def format_step(r: dict) -> str:
    """The one readable line per step."""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"step {r['step']:>5} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu | MFU {mfu} | "
            f"mem {r['peak_mem_gb']:.1f} GB | {r['step_time_s'] * 1000:.0f} ms"
            + (f" | loss scale {r['loss_scale']:g}" if "loss_scale" in r else "")
            + (" | non-finite gradient: step skipped" if r.get("skipped") else ""))


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
