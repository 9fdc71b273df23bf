"""Checkpoints: save every N steps, keep the last K, resume exactly, in any layout.

A checkpoint is a directory `<save_dir>/step_000100/` holding
- `weights-pp{P}-tp{T}.safetensors`: every rank that holds a distinct piece of the model
  (dp_rank 0, cp_rank 0: the other DP and CP ranks hold copies) writes its local tensors under
  their full-model names. The metadata records, per tensor, the full shape and the slice of it
  this file holds, so any layout (or one process) can cut out its own slices. A parameter
  replicated across TP ranks is written by tp_rank 0 only.
- `optimizer-pp{P}-tp{T}.safetensors`: AdamW's moments in the same form, named
  `<param name>.exp_avg` / `.exp_avg_sq` (they have the parameter's shape and slice), with the
  scalar state (the step count) in the metadata: keyed by name, not by position, so a later
  layout can read it.
- `rng-rank{R}.safetensors`: the Python, torch and CUDA RNG states of rank R, as tensors and
  JSON: nothing in a checkpoint is a pickle; restored only in the same layout.
- `state.json`, written last: step, tokens seen, data position, the config, the layout, the
  changes accepted at earlier resumes, under training.fp8="tensorwise_delayed" the FP8
  amaxes by site (speed/fp8/delayed.py, for any layout), a sha256 of every other file, and
  of itself.

Saving (picotron/checkpoint/write.py, picotron/checkpoint/async_save.py) is atomic: everything goes
into `<dir>.tmp`, renamed to `<dir>` once complete, then `<save_dir>/latest` names it.
Loading trusts a checkpoint only as a whole (picotron/checkpoint/verify.py): every rank hashes
a share of its files and the ranks agree on what they found before any of them loads, so a
bad file is refused by name on every rank together; and a resume that would change the run
(another seed, dataset, global batch, sequence length or model) is refused unless
`checkpoint.allow_changes` accepts it (picotron/checkpoint/changes.py).
"""
import glob
import json
import os
import random
import sys

import torch
import torch.distributed as dist
from safetensors import safe_open

from picotron.checkpoint.async_save import CheckpointSaver
from picotron.checkpoint.changes import check_model_shape, check_resume, schedule_change
from picotron.checkpoint.find import (check_new_run, checkpoint_to_read,  # noqa: F401
                                      complete_checkpoints, existing_run, find_checkpoint,
                                      resolve_checkpoint, verified)
from picotron.checkpoint.shards import (CheckpointError, SharedCheckpointError,  # noqa: F401
                                        index_shards, load_full_weights, read_slice,
                                        shard_metadata, slice_bounds)


def save_checkpoint(model, optimizer, pgm, config, save_root: str, step: int, state: dict) -> str:
    """Write `<save_root>/step_{step:06d}` now (weights, optimizer, RNG, `state`: tokens
    seen, data position), point `latest` at it, delete beyond `keep_last`. Collective.
    train.py keeps one CheckpointSaver instead, which can write in the background."""
    return CheckpointSaver(async_save=False).save(model, optimizer, pgm, config, save_root,
                                                  step, state)


def resume(config, run_dir: str, model, optimizer, pgm, data) -> tuple:
    """(step, tokens seen, accepted changes) to continue from: checkpoint.load_path's, or
    (0, 0, []) when it is unset, or "latest" with nothing saved yet (so one command both starts
    and resumes). Collective: every rank refuses a bad checkpoint together."""
    if not config.checkpoint.load_path:
        return 0, 0, []
    path, state, saved = find_checkpoint(config.checkpoint.load_path,
                                         save_root(config, run_dir), run_dir, pgm)
    if path is None:
        return 0, 0, []
    history = check_resume(state, saved, config, path, getattr(data, "num_windows", None),
                           getattr(data, "contents", None))
    if len(history) > len(state.get("accepted_changes") or []) and pgm.global_rank == 0:
        print(f"warning: resuming {path} with changes (checkpoint.allow_changes's, or another "
              f"precision), recorded in the next checkpoints: {history[-1]['changes']}",
              flush=True)
    _agree(lambda: _load(path, state, model, optimizer, pgm))
    if pgm.global_rank == 0:      # said once; a schedule the user changed, with its lrs
        change = schedule_change(saved, config, state["step"])
        print(f"resumed at step {state['step']} from {config.checkpoint.load_path}"
              + (f"; {change}" if change else ""), flush=True)
    return state["step"], state["tokens_seen"], history


def save_root(config, run_dir: str) -> str:
    return os.path.join(run_dir, config.checkpoint.save_dir)   # an absolute save_dir wins


def load_checkpoint(directory: str, model, optimizer, pgm, config) -> dict:
    """Load weights, optimizer state and RNG states after checking the whole checkpoint;
    return its state (step, tokens seen, data position). Collective. A bad checkpoint is
    refused on every rank before anything is changed."""
    state, saved, problems = verified(directory, pgm)
    if problems:
        raise SharedCheckpointError("; ".join(problems))
    check_model_shape(saved, config, directory)
    _agree(lambda: _load(directory, state, model, optimizer, pgm))
    return state


def _agree(load) -> None:
    """Run `load` (read everything, then apply) on every rank; if any rank cannot read its
    part, every rank raises, none applies."""
    apply, error = None, None
    try:
        apply = load()
    except CheckpointError as e:
        error = str(e)
    except Exception as e:     # whatever it is, the other ranks must hear of it, not hang
        error = f"loading the checkpoint failed ({type(e).__name__}: {e})"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        raise SharedCheckpointError(failed[0])
    apply()


def _load(directory: str, state: dict, model, optimizer, pgm):
    """Read and check this rank's part of a verified checkpoint; return a function that
    puts it into the model, the optimizer and the RNGs (nothing is changed before), and
    records where the weights came from (`model.weights_from`, as load_hf_weights does)."""
    shards = lambda kind: sorted(glob.glob(os.path.join(directory, f"{kind}-*.safetensors")))
    index = index_shards(shards("weights"))           # already verified against the manifest
    # A pipeline copy of a tied weight loads (weights and moments) under the original's name.
    params = [(getattr(p, "tied_name", n), p) for n, p in model.named_parameters()]
    wrong = [f"'{n}' (model {list(getattr(p, 'full_shape', p.shape))}, checkpoint "
             f"{index[n][0][2] if n in index else 'missing'})" for n, p in params
             if n not in index or list(index[n][0][2]) != list(getattr(p, "full_shape",
                                                                           p.shape))]
    if wrong:
        raise CheckpointError(f"checkpoint {directory} does not fit the model: "
                              + ", ".join(wrong))
    values = {n: read_slice(index, n, slice_bounds(p)) for n, p in params}
    opt_state = _read_optimizer(directory, shards("optimizer"), params) if optimizer else None
    same_layout = state["layout"] == {k: getattr(pgm, f"{k}_size") for k in ("dp", "pp", "cp",
                                                                             "tp")}
    # RNG streams belong to a rank: restored only in the same layout
    rng = _read_rng(os.path.join(directory, f"rng-rank{pgm.global_rank}.safetensors")
                    ) if same_layout else None

    def apply():
        with torch.no_grad():
            for n, p in params:
                p.copy_(values[n])
        # for the run's first lines: every tensor of the model, each rank reading its slices
        model.weights_from = (f"loaded from checkpoint {directory} (step {state['step']}, "
                              f"{len(index)} tensors)")
        if optimizer is not None:
            optimizer.load_param_state(opt_state)   # moments and masters into this rank's shards
            # a scale saved by an fp16 run; another dtype's is 1 (no scaling), and an fp16
            # run resumed from it starts at training.initial_loss_scale instead
            if "loss_scale" in state and state["config"]["training"]["dtype"] == "float16":
                optimizer.scaler.load_state_dict(state["loss_scale"])
        if rng is not None:
            _set_rng(rng)
        ledger = getattr(model, "fp8_ledger", None)      # delayed FP8 scales, in any layout
        saved = state.get("fp8_amaxes")
        if ledger is not None and saved:
            taken = ledger.load_amaxes(saved["amaxes"], next(model.parameters()).device,
                                       dy_ratio=pgm.dp_size * pgm.cp_size / saved["dy_scale"],
                                       rolls=saved.get("rolls_since_saturation"))
            if not taken and pgm.global_rank == 0:
                print(f"warning: {directory} holds delayed FP8 amaxes for other projections "
                      f"than this model's (another model.kernels?); the first step "
                      f"calibrates them afresh", file=sys.stderr, flush=True)
    return apply


def _read_optimizer(directory: str, files: list, params: list) -> dict:
    """{param: {key: tensor}, "step": n}. Either every parameter has moments or none has (a
    checkpoint of a run whose steps were all skipped); anything between is refused."""
    opt_index = index_shards(files)
    per_param = {k: v for f in files for k, v in (shard_metadata(f, "state") or {}).items()}
    with_moments = [n for n, _ in params if per_param.get(n, {}).get("tensors")]
    if with_moments and len(with_moments) != len(params):
        missing = [n for n, _ in params if n not in with_moments]
        raise CheckpointError(f"checkpoint {directory} has optimizer state for some "
                              f"parameters but not for {missing}; it is incomplete: resume "
                              f"from another checkpoint")
    opt_state = {}
    for n, p in params:
        if n in with_moments:
            opt_state["step"] = int(per_param[n]["scalars"]["step"])
            opt_state[p] = {key: read_slice(opt_index, f"{n}.{key}", slice_bounds(p))
                            for key in per_param[n]["tensors"]}
    return opt_state


def _read_rng(path: str) -> dict:
    try:
        with safe_open(path, "pt") as f:
            rng = {k: f.get_tensor(k) for k in f.keys()}
            python = json.loads((f.metadata() or {})["python"])
        rng["python"] = (python[0], tuple(python[1]), python[2])
    except Exception as e:     # verified, so only a file changed since: name it
        raise CheckpointError(f"{path} is not a readable RNG state ({type(e).__name__}: {e})"
                              ) from None
    return rng


def _set_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted((k for k in rng if k.startswith("cuda.")),
                                   key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
