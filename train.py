"""Train: `torchrun --nproc_per_node N train.py --config tmp/NAME/config.json`.

Read top to bottom: set-up (processes, config, grid), build (model on the meta device,
parallelism, weights), then the training loop. `python train.py --config ...` also works for
one process without torchrun.
"""
import argparse
import contextlib
import datetime
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from picotron.attention import resolve_attention
from picotron.checkpoint import CheckpointError, resume, save_checkpoint, save_root
from picotron.config import ConfigError, MissingPackage, load_config
from picotron.context_parallel import apply_context_parallel
from picotron.data import DataError, StepBatches, build_train_val, data_state
from picotron.data_parallel import DistributedAdamW, GradBuckets
from picotron.hf_io import load_hf_weights
from picotron.model import Decoder, materialize
from picotron.ops.cuda_graphs import capture_layers
from picotron.pipeline_parallel import (apply_pipeline_parallel, describe_split,
                                        pipeline_train_step)
from picotron.process_group_manager import ProcessGroupManager
from picotron.tensor_parallel import apply_tensor_parallel, loss_function
from picotron.utils import (MetricsLog, StepValues, count_params, flops_per_token, format_step,
                            lr_at, peak_flops, set_seed)
from picotron.validation import validation_loss


def setup(config_path):
    """Process group, validated config, device and grid. torchrun's variables are read once."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    config = load_config(config_path, world_size=world_size)
    if config.distributed.use_cpu:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            raise ConfigError("distributed.use_cpu is false but no CUDA GPU is visible; "
                              "run on a GPU machine or recreate the config with --use_cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    # A rank blocked longer than timeout_s (e.g. receiving from a stage that died) fails.
    timeout = datetime.timedelta(seconds=config.distributed.timeout_s)
    # An existing group is kept: a caller may run several trainings in one process
    # (tests/workers/train_many.py runs many layouts in one launch).
    if not dist.is_initialized():
        if "RANK" in os.environ:      # launched by torchrun: rendezvous through its variables
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=device if backend == "nccl" else None)
        else:                         # plain `python train.py`: a one-process group in memory
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    d = config.distributed
    pgm = ProcessGroupManager(d.dp_size, d.pp_size, d.cp_size, d.tp_size, timeout=timeout)
    return config, pgm, device


def build_model(config, pgm, device):
    """The model is declared on the meta device (no memory), parallelism is applied to that
    skeleton, and only then does each rank draw the weights it owns."""
    dtype = getattr(torch, config.training.dtype)
    attention_fn = resolve_attention(config.model.attn_implementation, device.type)
    with torch.device("meta"):
        model = Decoder(config.model, attention_fn, config.training.activation_checkpointing,
                        config.training.activation_checkpointing_layers)
    # Parallelism is applied to the skeleton here, one `apply_<axis>(model, pgm, config)` per
    # axis, in this order: tensor parallel (swap linears for sharded ones, so the pipeline
    # split below moves sharded layers), pipeline parallel (keep this stage's layers),
    # context parallel (swap the attention function for ring attention).
    model = apply_tensor_parallel(model, pgm, config)
    model = apply_pipeline_parallel(model, pgm, config)
    model = apply_context_parallel(model, pgm, config)
    model = materialize(model, config.training.seed, device, dtype,
                        config.model.initializer_range)
    if config.checkpoint.init_from:   # pretrained weights replace the random draw, never after
        load_hf_weights(model, config.checkpoint.init_from)
    if config.training.compile:       # in place: parameter names stay those of the layout
        for layer in model.layers.values():
            layer.compile()
    return model


def train_step(model, loss_fn, grads, batches, step, config, pgm, device, loss_scale):
    """One optimizer step's forward and backward over all micro-batches; returns the mean loss.

    Each micro-batch's loss is divided by the number of micro-batches, so the gradients are
    those of the mean loss over the global batch. Only the last micro-batch's backward starts
    the gradient reductions (`grads.sync`); `loss_scale` is 1 except with fp16."""
    if pgm.pp_size > 1:     # the schedule runs the micro-batches (same loss scaling)
        return pipeline_train_step(model, loss_fn, grads, batches, step, config, pgm,
                                   loss_scale)
    accum = config.training.gradient_accumulation_steps
    total = torch.zeros((), device=device)
    for micro in range(accum):
        # This DP rank's samples; under context parallelism its zigzag share of the tokens,
        # their targets and true positions (all of them, 0..T-1, when cp_size is 1).
        inputs, targets, position_ids = batches.get(step, micro)
        # (B, T, V) logits; or the final hidden (B, T, C) when the loss applies the head itself
        out = model(inputs, position_ids, head=not getattr(loss_fn, "applies_head", False))
        loss = loss_fn(out, targets) / accum
        grads.sync = micro == accum - 1
        (loss * loss_scale).backward()
        total += loss.detach()
    return total


def queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm, device):
    """One optimizer step, queued without waiting for the device: forward and backward,
    gradient reductions, AdamW, and the next step's batches. Returns its StepValues (loss,
    grad norm, skipped), to be read once the next step is queued."""
    t = config.training
    lr = lr_at(step + 1, t)
    loss = train_step(model, loss_fn, grads, batches, step, config, pgm, device,
                      optimizer.scaler.scale)
    grads.finish()                                      # wait for the gradient reductions
    dist.all_reduce(loss, group=pgm.cp_dp_group)         # each rank's share of the mean
    loss /= pgm.cp_dp_size
    grad_norm, skipped = optimizer.step(lr)              # clip, step, share ZeRO shards
    grads.zero_grad()
    if step + 1 < t.total_train_steps:       # cut and queue the next step's batches now,
        batches.prefetch(step + 1)           # while the device still runs this step
    return StepValues({"step": step + 1, "lr": lr, "loss": loss, "grad_norm": grad_norm,
                       "skipped": skipped, "loss_scale": optimizer.scaler.scale}, device)


def peak_memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB -> GiB


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a picotron model.")
    parser.add_argument("--config", required=True, help="path to a config.json")
    args = parser.parse_args(argv)

    # ---- set-up -------------------------------------------------------------------------
    owns_group = not dist.is_initialized()
    config, pgm, device = setup(args.config)
    t = config.training
    set_seed(t.seed)
    run_dir = config.logging.run_dir or os.path.dirname(os.path.abspath(args.config))
    is_logger = (pgm.pp_is_last_stage and pgm.dp_rank == 0 and pgm.cp_rank == 0
                 and pgm.tp_rank == 0)      # holds the loss; everyone else stays quiet
    tokens_per_step = config.global_batch_size * t.seq_length
    flops_tok = flops_per_token(config.model, t.seq_length)
    peak = peak_flops(device)
    if is_logger:
        d = config.distributed
        print(f"{pgm}\nlayout dp={d.dp_size} tp={d.tp_size} pp={d.pp_size} cp={d.cp_size} "
              f"on {config.world_size} {'CPU processes' if d.use_cpu else 'GPUs'} ({device.type})"
              f"\nmodel {config.model.name}: {count_params(config.model) / 1e6:.2f}M parameters,"
              f" {flops_tok / 1e9:.3f} GFLOPs/token (6N + 12*L*C*T)\n"
              f"global batch {config.global_batch_size} sequences = mbs {t.micro_batch_size} x "
              f"grad_acc {t.gradient_accumulation_steps} x dp {d.dp_size}; {tokens_per_step} "
              f"tokens/step; dtype {t.dtype}; run dir {run_dir}", flush=True)
        if d.pp_size > 1:
            print(describe_split(config), flush=True)

    # ---- build --------------------------------------------------------------------------
    model = build_model(config, pgm, device)
    grads = GradBuckets(model, pgm, config)            # parameters now live in flat buckets
    if t.cuda_graphs:        # captured where the parameters now live (written in place later)
        capture_layers(model, config, device)
    optimizer = DistributedAdamW(grads, pgm, config)
    loss_fn = loss_function(pgm, config, model)   # vocab-parallel when the logits are sharded
    data, val_data = build_train_val(config, run_dir)
    batches = StepBatches(data, config, pgm, device)   # this rank's micro-batches of a step
    # Resume: weights, optimizer, RNG, step, tokens seen; the data position is the step.
    start_step, tokens_seen = resume(config, run_dir, model, optimizer, pgm, data)
    if is_logger and start_step:
        print(f"resumed at step {start_step} from {config.checkpoint.load_path}", flush=True)
    metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), is_logger, config,
                         keep_until_step=start_step)

    # ---- train --------------------------------------------------------------------------
    # Each step's loss and grad norm are read once the next step is queued (StepValues): the
    # GPU never waits for the host to log. Validation and checkpoints read them first.
    pending, clock = None, time.perf_counter()

    def log(done: StepValues):
        nonlocal tokens_seen, clock
        r = done.read()                                  # waits for that step only
        now = time.perf_counter()
        step_time, clock = now - clock, now
        tokens_seen += tokens_per_step
        per_gpu = tokens_per_step / step_time / config.world_size
        record = {"step": r["step"], "loss": r["loss"], "lr": r["lr"],
                  "grad_norm": r["grad_norm"], "tokens": tokens_seen,
                  "tokens_per_s": tokens_per_step / step_time, "tokens_per_s_per_gpu": per_gpu,
                  "tflops_per_gpu": per_gpu * flops_tok / 1e12,
                  "mfu": per_gpu * flops_tok / peak if peak else None,
                  "peak_mem_gb": peak_memory_gb(device), "step_time_s": step_time,
                  "skipped": bool(r["skipped"])}    # a non-finite gradient norm: no update
        if t.dtype == "float16":
            record["loss_scale"] = r["loss_scale"]
        metrics.write(record)
        if is_logger and r["step"] % config.logging.log_frequency == 0:
            print(format_step(record), flush=True)

    try:
        for step in range(start_step, t.total_train_steps):
            done = queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm,
                              device)
            previous, pending = pending, done
            if previous is not None:
                log(previous)                    # the step before this one, now finished
            every = config.checkpoint.save_frequency
            validate = t.val_frequency and (step + 1) % t.val_frequency == 0
            save = every and ((step + 1) % every == 0 or step + 1 == t.total_train_steps)
            if not (validate or save or step + 1 == t.total_train_steps):
                continue
            finished, pending = pending, None
            log(finished)
            if validate:
                val = validation_loss(model, loss_fn, val_data, config, pgm, device)
                metrics.write({"step": step + 1, "val_loss": val})
                if is_logger:
                    print(f"step {step + 1:>5} | val loss {val:.4f}", flush=True)
            if save:
                save_checkpoint(model, optimizer, pgm, config, save_root(config, run_dir), step + 1,
                                {"tokens_seen": tokens_seen, "data": data_state(config, step + 1,
                                                                                data)})
            clock = time.perf_counter()          # the next step's time leaves these out
    except BaseException:      # a crash or Ctrl-C: the last finished step is still logged
        if pending is not None:
            with contextlib.suppress(Exception):
                log(pending)
        raise
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, MissingPackage, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
