"""Train: `python train.py [--nproc_per_node N] --config tmp/NAME/config.json` (N workers
through torch's launcher, torchrun's flags; `torchrun ... train.py` works too; N = dp*tp*pp*cp;
with no `--config`: the debug preset, in tmp/debug).

Read top to bottom: set-up (processes, config, grid), build (model on the meta device,
parallelism, weights), then the training loop.
"""
import argparse
import contextlib
import datetime
import os
import sys
import time

# OpenMP's threads sleep at barriers, never spin (bench/NOTES.md, "CPU threads"); before torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.distributed as dist

from create_config import debug_config
from picotron.attention import resolve_attention
from picotron.checkpoint.checkpoint import CheckpointSaver, check_new_run, resume, save_root
from picotron.config import load_config
from picotron.config.overrides import parse_flags
from picotron.context_parallel import apply_context_parallel
from picotron.data.windows import StepBatches, build_train_val, data_state
from picotron.data_parallel import GradBuckets, ShardedParams
from picotron.checkpoint.hf_io import load_hf_weights
from picotron.loss import build_loss
from picotron.plan.memory_plan import check_memory
from picotron.run.metrics_log import MetricsLog, import_loggers
from picotron.model import Decoder, materialize
from picotron.run.launch_workers import add_launch_flags, launch_workers, wants_launch
from picotron.run.run_lock import claim_run_dir
from picotron.pipeline_parallel import apply_pipeline_parallel, pipeline_train_step
from picotron.process_group_manager import ProcessGroupManager, check_nodes, device_and_backend
from picotron.run.report import (StartupPhases, config_read, data_warning, describe_run,
                                 launch_lines)
from picotron.run.run_end import end_stopped_run, run_and_end, summary
from picotron.speed import apply_speed, build_optimizer, capture_layers
from picotron.speed.fp8.layers import fp8_step_values, settle_auto_fp8
from picotron.run.step_log import StepLog
from picotron.tensor_parallel import apply_tensor_parallel
from picotron.utils import StepValues, lr_at, set_cpu_threads, set_seed
from picotron.data.validation import validation_line, validation_loss, validation_record
from picotron.run.watchdog import Watchdog


def setup(config_path, overrides=()):
    """Process group, validated config (the file, then the `--set` overrides), device and
    grid. torchrun's variables are read once."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # on this machine
    config = load_config(config_path, world_size=world_size, overrides=overrides)
    d = config.distributed     # more than one node: tp must not cross one (the network)
    if rank == 0:   # the first sign of life: the process groups and the build take a while
        print(config_read(config, world_size), flush=True)
    node_warning = check_nodes(d.tp_size, d.cp_size, local_world_size, world_size)
    if node_warning and rank == 0:
        print(node_warning, file=sys.stderr, flush=True)
    device, backend = device_and_backend(d, local_rank)     # share_gpu: cuda:0 over gloo
    if device.type == "cpu":
        set_cpu_threads(local_world_size, d.cpu_threads)  # cores / processes here, or as set
    else:
        torch.cuda.set_device(device)
        fallback = settle_auto_fp8(config)     # FP8 that "auto" chose, where torch lacks it
        if fallback and rank == 0:
            print(fallback, file=sys.stderr, flush=True)
    check_memory(config, device)    # the estimate must fit before anything is allocated
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
    return config, ProcessGroupManager.from_config(config), device


def build_model(config, pgm, device):
    """The model is declared on the meta device (no memory), parallelism is applied to that
    skeleton, and only then does each rank draw the weights it owns."""
    dtype = getattr(torch, config.training.dtype)
    attention_fn = resolve_attention(config.model.attn_implementation, device.type)
    with torch.device("meta"):
        model = Decoder(config.model, attention_fn)
    # Parallelism is applied to the skeleton here, one `apply_<axis>(model, pgm, config)` per
    # axis, in this order: tensor parallel (swap linears for sharded ones, so the pipeline
    # split below moves sharded layers), pipeline parallel (keep this stage's layers),
    # context parallel (swap the attention function for ring attention or Ulysses).
    model = apply_tensor_parallel(model, pgm, config)
    model = apply_pipeline_parallel(model, pgm, config)
    model = apply_context_parallel(model, pgm, config)
    model.weights_from = f"random init (seed {config.training.seed})"   # a load rewrites it
    if config.distributed.zero_stage == 3:   # ShardedParams draws (and loads) shards later
        return model
    model = materialize(model, config.training.seed, device, dtype,
                        config.model.initializer_range)
    if config.checkpoint.init_from:   # pretrained weights replace the random draw, never after
        load_hf_weights(model, config.checkpoint.init_from)
    return model


def build_training(config, pgm, device):
    """Everything a step needs: (model, loss_fn, grads, optimizer). The speed plug-ins are
    applied to the finished model from outside, before the parameters move into the gradient
    buckets; CUDA graphs are captured after, where the parameters then live."""
    model = build_model(config, pgm, device)           # the textbook model, axes applied
    loss_fn = build_loss(pgm)                          # vocab-parallel when tp shards logits
    model, loss_fn = apply_speed(model, loss_fn, config, pgm.tp_group,    # kernels, fp8, ...
                                 pgm.cp_dp_group, pgm.cp_group)
    if config.distributed.zero_stage == 3:    # parameters drawn as shards, gathered per layer
        grads = ShardedParams(model, pgm, config, device)
        if config.checkpoint.init_from:      # whole while the weights load, then shards again
            with grads.full_parameters(write_back=True):
                load_hf_weights(model, config.checkpoint.init_from)
    else:
        grads = GradBuckets(model, pgm, config)        # parameters now live in flat buckets
    if config.training.cuda_graphs:    # written in place from now on, so the graphs stay valid
        capture_layers(model, config, device, grads)
    optimizer = build_optimizer(grads, pgm, config, device)
    return model, loss_fn, grads, optimizer


def train_step(model, loss_fn, grads, batches, step, config, pgm, device, loss_scale):
    """One optimizer step's forward and backward over all micro-batches; returns the mean loss.

    Each micro-batch's loss is divided by the number of micro-batches, so the gradients are
    those of the mean loss over the global batch. Only the last micro-batch's backward starts
    the gradient reductions (`grads.sync`; ZeRO-3 instead reduce-scatters each micro-batch's
    gradients as they complete); `loss_scale` is 1 except with fp16."""
    if pgm.pp_size > 1:     # the schedule runs the micro-batches (same loss scaling)
        return pipeline_train_step(model, loss_fn, grads, batches, step, config, pgm,
                                   loss_scale)
    accum = config.training.gradient_accumulation_steps
    total = torch.zeros((), device=device)
    for micro in range(accum):
        # This DP rank's samples; under context parallelism its zigzag share of the tokens,
        # their targets and true positions (all of them, 0..T-1, when cp_size is 1).
        inputs, targets, position_ids = batches.get(step, micro)
        loss = loss_fn(model(inputs, position_ids), targets) / accum
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
                       "skipped": skipped, "loss_scale": optimizer.scaler.scale,
                       **fp8_step_values(model, pgm.pp_group)}, device)   # FP8 saturation


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", type=os.path.expanduser, help="the run's config.json (by "
                        "create_config.py; outputs go to its folder unless logging.run_dir "
                        "says otherwise); none: the debug preset, in tmp/debug/config.json")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a key of the config file for this launch (repeatable, "
                        "checked, recorded in RUN_DIR/launches.jsonl): checkpoint.load_path=latest")
    add_launch_flags(parser)
    args = parse_flags(parser, argv)
    args.config = args.config or debug_config()      # written on first use, then reused
    return args


def main(argv=None):
    args = parse_args(argv)
    if wants_launch(args):     # this process starts the workers, each runs main() below
        sys.exit(launch_workers(args, os.path.abspath(__file__)))

    # ---- set-up -------------------------------------------------------------------------
    owns_group, set_up_from = not dist.is_initialized(), time.perf_counter()
    config, pgm, device = setup(args.config, args.set)
    t = config.training
    set_seed(t.seed)
    run_dir = config.logging.run_dir or os.path.dirname(os.path.abspath(args.config))
    run_lock = claim_run_dir(config, run_dir)   # unwritable, or another run's: refused now
    if not config.checkpoint.load_path:    # and a new run over an earlier one's outputs
        check_new_run(run_dir, save_root(config, run_dir))
    import_loggers(config)                 # and a logger whose package is missing
    is_logger = (pgm.pp_is_last_stage and pgm.dp_rank == 0 and pgm.cp_rank == 0
                 and pgm.tp_rank == 0)      # holds the loss; everyone else stays quiet
    watchdog = Watchdog(config, is_logger, run_lock)  # dead or frozen ranks, signals, ...
    watchdog.start()
    if is_logger:
        print(describe_run(config, pgm, device, run_dir, args.set), flush=True)
    phases = StartupPhases(is_logger, since=set_up_from)   # a line a phase: a slow start shows
    phases.done("process groups and checks")

    # ---- build --------------------------------------------------------------------------
    model, loss_fn, grads, optimizer = build_training(config, pgm, device)
    phases.done("model built")
    data, val_data = build_train_val(config, run_dir)
    batches = StepBatches(data, config, pgm, device)   # this rank's micro-batches of a step
    phases.done("data ready")
    if is_logger and data_warning(config, data):
        print(data_warning(config, data), file=sys.stderr, flush=True)
    # Resume: weights, optimizer, RNG, step, tokens seen; the data position is the step.
    # A change of seed, data or batch is refused unless allowed, and then carried along.
    # ZeRO-3 holds the parameters whole while a checkpoint loads into them, then its shards
    with (grads.full_parameters(write_back=True) if config.checkpoint.load_path
          else contextlib.nullcontext()):
        start_step, tokens_seen, accepted_changes = resume(config, run_dir, model, optimizer,
                                                           pgm, data)
    if is_logger:   # resume() said its step and a schedule that changes; now the launch
        launch_lines(config, run_dir, start_step, model.weights_from, args.set)  # record
    metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), is_logger, config,
                         keep_until_step=start_step)
    # Each step's loss and grad norm are read once the next step is queued, so the GPU never
    # waits for the host to log; validation, checkpoints and the end read them first (flush).
    log = StepLog(metrics, config, device, tokens_seen=tokens_seen, is_logger=is_logger,
                  save_dir=save_root(config, run_dir), on_diverged=watchdog.request_stop)

    # ---- train --------------------------------------------------------------------------
    started, val, saved, stop, left_out = time.perf_counter(), None, None, False, None
    saver = CheckpointSaver(config.checkpoint.async_save)   # files written in the background?
    try:
        for step in range(start_step, t.total_train_steps):
            log.start(step)
            log.queued(queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm,
                                  device))
            phases.first_step_queued()
            watchdog.step = step + 1    # a signal or a diverged loss: all stop after one step
            stop = watchdog.stop_requested(step + 1)
            every, last = config.checkpoint.save_frequency, step + 1 == t.total_train_steps
            validate = t.val_frequency and (step + 1) % t.val_frequency == 0
            save = ((every and (step + 1) % every == 0) or (last and (every or config.checkpoint
                    .save_final)) or (stop and config.checkpoint.save_on_sigterm))
            save = save and not (stop and watchdog.stop[0] == "diverged")   # no diverged save
            if not (validate or save or last or stop):
                continue
            log.flush()
            if validate:
                val = validation_record(step + 1, validation_loss(
                    model, loss_fn, val_data, config, pgm, device), config)  # + bits per byte
                metrics.write(val)
                if is_logger:
                    print(validation_line(val), flush=True)
            if save and log.skips.skipping:    # a skipped step: no checkpoint, `latest` kept
                left_out = log.skips.leave_out(
                    os.path.join(save_root(config, run_dir), f"step_{step + 1:06d}"), is_logger)
            elif save:
                left_out = None
                with grads.full_parameters():           # ZeRO-3: gathered for the save
                    saved = saver.save(model, optimizer, pgm, config, save_root(config, run_dir),
                                       step + 1, {"tokens_seen": log.tokens_seen,
                                                  "data": data_state(config, step + 1, data),
                                                  "accepted_changes": accepted_changes})
                watchdog.last_checkpoint = saved
            if stop:
                break
        saver.wait()           # the save in flight is complete, or its error raised here
        if not stop:           # ended skipping: status 2, `latest` as before the skips
            log.skips.check_end(device)
    except BaseException:      # a crash: the last finished step is still logged
        with contextlib.suppress(Exception):
            log.flush()
        saver.finish_writing()     # an async save in flight: its checkpoint is not lost
        raise
    watchdog.close()
    if is_logger and start_step < t.total_train_steps:
        print(summary(log, started, start_step, watchdog.step, val, saved, metrics.path,
                      left_out, stopped=stop), flush=True)
    if stop:              # one line, status 143 (SIGTERM) or 130 (Ctrl-C); diverged: an error
        end_stopped_run(watchdog.stop, watchdog.step, saved, is_logger, left_out)
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)    # a refused run, a stop, a peer gone: one line and its status
