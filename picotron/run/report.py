"""What a run says as it starts: its first lines and the launch record.

A user watching a run wants to know what was chosen for them (the first lines), how far it is
and how long is left (picotron/run/step_log.py's step line), and at the end what it did and
where its outputs are (picotron/run/run_end.py).
"""
import datetime
import json
import os
import sys
import time

import torch

from picotron.attention import resolved_name
from picotron.checkpoint.checkpoint import save_root
from picotron.config.checks import config_warnings
from picotron.config.overrides import repeated_keys
from picotron.pipeline_parallel import describe_split
from picotron.run.metrics_log import set_aside_metrics
from picotron.utils import count_params, flops_per_token, plural, process_age


def describe_run(config, pgm, device, run_dir, overrides=()) -> str:
    """The run's first lines: what "auto" chose, the grid, the model, the batch, and the
    warnings (`overrides`: the launch's --set items, a key given twice among them)."""
    d, t = config.distributed, config.training
    auto = getattr(config, "auto_resolved", {})
    chosen = ", ".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}"   # as --set takes
                       for k, v in auto.items())
    tokens_per_step = config.global_batch_size * t.seq_length
    flops_tok = flops_per_token(config.model, t.seq_length)
    lines = [f"auto on {device.type}: {chosen}"] if chosen else []
    wait = os.environ.get("OMP_WAIT_POLICY", "active").lower()    # train.py's: passive
    threads = (f", {plural(torch.get_num_threads(), 'CPU thread')} each, OpenMP wait {wait}; "
               f"--set distributed.cpu_threads=N to change" if device.type == "cpu" else "")
    lines += [f"{pgm} (this rank logs: the last pipeline stage's first rank holds the loss)",
              f"layout dp={d.dp_size} tp={d.tp_size} pp={d.pp_size} cp={d.cp_size} on "
              + (f"{config.world_size} ranks sharing one GPU ({device}; throughput means "
                 f"nothing)" if d.share_gpu and not d.use_cpu else
                 f"{plural(config.world_size, 'CPU process' if d.use_cpu else 'GPU')} "
                 f"({device.type}{threads})"),
              f"model {config.model.name}: {count_params(config.model) / 1e6:.2f}M parameters, "
              f"{flops_tok / 1e9:.3f} GFLOPs/token (6N + 12*L*C*T); kernels "
              f"{config.model.kernels}, loss {t.fused_loss}, recompute "
              f"{t.activation_checkpointing}" + (f", fp8 {t.fp8}" if t.fp8 != "none" else "")
              + f"; attention: {describe_attention(config, device)}",
              f"global batch {config.global_batch_size} sequences = mbs {t.micro_batch_size} x "
              f"grad_acc {t.gradient_accumulation_steps} x dp {d.dp_size}; {tokens_per_step} "
              f"tokens/step; {t.total_train_steps} steps; dtype {t.dtype}; run dir {run_dir}"]
    if t.fp8 != "none":
        lines.append(f"FP8: the decoder layers' projection GEMMs (q/k/v, o, gate/up, down) run in "
                     f"FP8 with the {t.fp8} recipe" + (
                         " (each scale from the previous step's amax; saturation counted in "
                         "metrics.jsonl and guarded)" if t.fp8 == "tensorwise_delayed" else "")
                     + "; --set training.fp8=none runs them in bf16")
    if d.pp_size > 1:
        lines.append(describe_split(config))
    lines += [f"warning: {w}" for w in repeated_keys(overrides) + config_warnings(config)]
    return "\n".join(lines)


# SDPA's kernels, by the names of torch.nn.attention.SDPBackend
SDPA_KERNELS = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION":
                "memory-efficient", "CUDNN_ATTENTION": "cuDNN", "OVERRIDEABLE": "a backend's own"}


def sdpa_kernel(heads: int, kv_heads: int, seq: int, head_dim: int, dtype, device,
                contiguous: bool = False):
    """Which of its kernels SDPA runs in training for one sequence of this shape, or None where
    torch cannot say (the choice is a private function of torch's). It picks by device, dtype,
    head size, sequence length, layout and whether gradients are needed, so it is asked with
    empty tensors that need them, laid out as the model's projections leave q, k and v: (1, T,
    H, D) viewed as (1, H, T, D), or (1, H, T, D) itself where `contiguous` (Ulysses)."""
    from torch.nn.attention import SDPBackend

    def probe(n):
        if contiguous:
            return torch.empty(1, n, seq, head_dim, dtype=dtype, device=device,
                               requires_grad=True)
        return torch.empty(1, seq, n, head_dim, dtype=dtype, device=device,
                           requires_grad=True).transpose(1, 2)
    q, k = probe(heads), probe(kv_heads)
    try:        # a private function of torch's: a line of the run's report must not end it
        choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=heads != kv_heads)
    except (AttributeError, RuntimeError, TypeError):
        return None
    finally:
        del q, k
        if device.type == "cuda":       # the probe's blocks: not kept in this rank's cache
            torch.cuda.empty_cache()
    names = {backend.value: name for name, backend in SDPBackend.__members__.items()}
    return SDPA_KERNELS.get(names.get(choice), f"SDPBackend {choice}")


def describe_attention(config, device) -> str:
    """Which kernel runs a layer's attention on this rank. SDPA chooses at each call by device,
    dtype and shape (sdpa_kernel, above, asks it with this rank's shape)."""
    m, d = config.model, config.distributed
    name = resolved_name(m.attn_implementation, device.type)
    if d.cp_size > 1 and d.cp_mode != "ulysses":   # context_parallel/kernels.py's blocks
        block = ("eager" if name == "eager" else
                 "SDPA's memory-efficient" if device.type == "cuda" else "SDPA's CPU flash")
        return f"ring attention over {d.cp_size} ranks, {block} kernel per block"
    ulysses = d.cp_size         # 1, or Ulysses: each rank a head share of whole sequences
    heads = m.num_attention_heads // (d.tp_size * ulysses)
    kv_heads = m.num_key_value_heads // (d.tp_size * ulysses)
    if name == "sdpa":
        kernel = sdpa_kernel(heads, kv_heads, config.training.seq_length,
                             m.hidden_size // m.num_attention_heads,
                             getattr(torch, config.training.dtype), device,
                             contiguous=ulysses > 1)    # Ulysses' all-to-all leaves them so
        text = f"SDPA's {kernel} kernel" if kernel else "SDPA (its kernel not known here)"
    else:
        text = {"eager": "eager (the reference)", "flash_attention_2": "flash-attn 2"}[name]
    return f"Ulysses over {d.cp_size} ranks around {text}" if ulysses > 1 else text


def data_warning(config, data):
    """One line when the training data is smaller than one step's batch, else None."""
    windows = getattr(data, "num_windows", None)          # None: synthetic tokens
    if windows is not None and windows < config.global_batch_size:
        return (f"warning: the training data holds {windows} windows of "
                f"{config.training.seq_length + 1} tokens, fewer than the global batch of "
                f"{config.global_batch_size}: every step trains on some windows twice; use "
                f"more data (dataset.num_samples) or a smaller batch")
    return None


def record_launch(run_dir: str, argv: list, overrides: list, start_step: int) -> None:
    """Appends this launch to <run_dir>/launches.jsonl: when, the command line, the `--set`
    overrides applied on top of the config file, and the step it started from. The config
    file is never rewritten, so this is where a resumed or varied run's changes are kept."""
    os.makedirs(run_dir, exist_ok=True)
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": argv, "overrides": overrides, "start_step": start_step}
    path = os.path.join(run_dir, "launches.jsonl")
    with open(path, "a+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:             # a run killed mid-line: this record starts a line of its own
            f.seek(f.tell() - 1)
            ended = f.read(1) == "\n"
            f.write("" if ended else "\n")
        f.write(json.dumps(record) + "\n")


def config_read(config, world_size: int) -> str:
    """Rank 0's first line, before the process groups exist: the launch is alive."""
    d, age = config.distributed, process_age()
    started = "" if age is None else f", {age:.1f}s after this process started (imports)"
    shared = (f"\ndistributed.share_gpu: all {world_size} ranks share one GPU (cuda:0) over "
              f"gloo, collectives through host memory: a check of the numbers only, "
              f"tokens/s and MFU mean nothing" if d.share_gpu and not d.use_cpu else "")
    return (f"config read{started}: {plural(world_size, 'rank')} = dp {d.dp_size} x tp "
            f"{d.tp_size} x pp {d.pp_size} x cp {d.cp_size}; setting up" + shared)


def launch_lines(config, run_dir: str, start_step: int, weights_from: str, overrides) -> None:
    """The logging rank, after the resume: a resume of `latest` that found no checkpoint (an
    earlier run's metrics set aside), the launch's record, where the weights came from, and a
    checkpoint already at the last step."""
    total = config.training.total_train_steps
    if not start_step and config.checkpoint.load_path == "latest":       # none yet
        aside = set_aside_metrics(os.path.join(run_dir, "metrics.jsonl"))
        print(starting_fresh(save_root(config, run_dir), aside), flush=True)
    record_launch(run_dir, sys.argv, overrides, start_step)
    print(f"weights: {weights_from}", flush=True)   # drawn, or the last load's
    if start_step >= total:
        print(nothing_to_train(start_step, total), flush=True)


def starting_fresh(save_dir: str, metrics_aside) -> str:
    """A resume of `latest` that finds no checkpoint starts at step 0, and says so."""
    return (f"no checkpoint under {save_dir} yet: starting at step 0"
            + (f"; the metrics.jsonl of an earlier run there is now {metrics_aside}"
               if metrics_aside else ""))


def nothing_to_train(start_step: int, total_steps: int) -> str:
    return (f"nothing to train: the checkpoint is at step {start_step} and "
            f"training.total_train_steps={total_steps}; to train on, raise it "
            f"(e.g. --set training.total_train_steps={start_step + total_steps})")


class StartupPhases:
    """One line per phase of the start, with its seconds (`done("model built")` -> "model
    built in 4.2s"), so that a slow start (16 ranks on a small CPU: ~50 s) is visibly busy.
    `speak`: whether this rank prints (the logging rank); `since`: the first phase's start, a
    time.perf_counter() reading."""

    def __init__(self, speak: bool, since: float):
        self.speak, self.mark = speak, since

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        if self.speak:
            print(f"{phase} in {now - self.mark:.1f}s", flush=True)
        self.mark = now

    def first_step_queued(self) -> None:
        """Called after each step is queued; says the first one."""
        if self.mark is not None:
            self.done("first step queued")
            self.mark = None
