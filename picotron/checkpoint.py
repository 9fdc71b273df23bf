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
- `rng-rank{R}.pt`: the Python and torch RNG states of rank R.
- `state.json`, written last: step, tokens seen, data position, the config, the layout and a
  sha256 of every shard file (a flipped byte is caught on load, not trained on).

Writing is atomic: everything goes into `<dir>.tmp`, and one rank renames it to `<dir>` after
a barrier, then points `<save_dir>/latest` at it (written to a temporary name and renamed).
A save killed part-way leaves only a `.tmp` directory, which is never loaded.
"""
import glob
import json
import os
import random
import shutil

import torch
import torch.distributed as dist

from picotron.shards import (CheckpointError, index_shards, load_full_weights,  # noqa: F401
                             read_slice, shard_metadata, slice_bounds, write_shard)

FORMAT_VERSION = 1
# Model fields that fix the shapes of the weights: compared before anything is loaded.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
                "parallel_residual", "norm_type")


def _owned(model, pgm):
    """(name, param) pairs this rank writes: distinct pieces only (see the module doc)."""
    if pgm.dp_rank != 0 or pgm.cp_rank != 0:
        return []
    return [(n, p) for n, p in model.named_parameters()         # a pipeline copy of a tied
            if (hasattr(p, "local_slice") or pgm.tp_rank == 0)    # weight (`tied_name`) is
            and not hasattr(p, "tied_name")]                      # saved once, by stage 0


def _write_model_shards(model, opt_state, pgm, tmp: str) -> dict:
    """This rank's weight (and optimizer) files in `tmp`; {file name: sha256}.
    opt_state: DistributedAdamW.param_state(), or None for weights only."""
    owned = _owned(model, pgm)
    if not owned:
        return {}
    tag = f"pp{pgm.pp_rank}-tp{pgm.tp_rank}"
    layout = {n: {"full_shape": list(getattr(p, "full_shape", p.shape)),
                  "bounds": slice_bounds(p)} for n, p in owned}
    sums = {f"weights-{tag}.safetensors": write_shard(
        os.path.join(tmp, f"weights-{tag}.safetensors"), dict(owned), layout)}
    if opt_state is not None:
        tensors, opt_layout, per_param = {}, {}, {}
        for name, p in owned:
            entry = per_param[name] = {"scalars": {"step": opt_state["step"]}, "tensors": []}
            for key, value in opt_state.get(p, {}).items():      # moments (and master): like p
                tensors[f"{name}.{key}"], opt_layout[f"{name}.{key}"] = value, layout[name]
                entry["tensors"].append(key)
        fname = f"optimizer-{tag}.safetensors"
        sums[fname] = write_shard(os.path.join(tmp, fname), tensors, opt_layout,
                                  {"state": per_param})
    return sums


def save_checkpoint(model, optimizer, pgm, config, save_root: str, step: int, state: dict) -> str:
    """Write `<save_root>/step_{step:06d}` with weights, optimizer, RNG and `state` (step,
    tokens seen, data position), point `latest` at it, delete beyond `keep_last`. Collective."""
    directory = os.path.join(save_root, f"step_{step:06d}")
    state = {"format_version": FORMAT_VERSION, "step": step, **state,
             "layout": {k: getattr(pgm, f"{k}_size") for k in ("dp", "pp", "cp", "tp")},
             "config": config.to_dict()}
    if optimizer is not None:
        state["loss_scale"] = optimizer.scaler.state_dict()
    _save(model, optimizer, pgm, directory, state)
    if pgm.global_rank == 0:
        _atomic_write(os.path.join(save_root, "latest"), os.path.basename(directory) + "\n")
        if config.checkpoint.keep_last:
            for old in complete_checkpoints(save_root)[:-config.checkpoint.keep_last]:
                _remove(old)
        for debris in glob.glob(os.path.join(save_root, "step_*.tmp")) + glob.glob(
                os.path.join(save_root, "step_*.deleting")):      # left by earlier crashes
            shutil.rmtree(debris, ignore_errors=True)
    dist.barrier()
    return directory


def _save(model, optimizer, pgm, directory: str, state) -> None:
    tmp = directory + ".tmp"
    if pgm.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    # Collective under ZeRO (the optimizer shards are gathered), so every rank computes it.
    opt_state = optimizer.param_state() if optimizer is not None else None
    sums = _write_model_shards(model, opt_state, pgm, tmp)
    if state is not None:
        rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save(rng, os.path.join(tmp, f"rng-rank{pgm.global_rank}.pt"))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)          # also the barrier: every file is written
    if pgm.global_rank == 0:
        if state is not None:   # written last: a directory with state.json is complete
            state["sha256"] = {k: v for part in gathered for k, v in part.items()}
            _atomic_write(os.path.join(tmp, "state.json"), json.dumps(state, indent=1))
        if os.path.exists(directory):               # re-saving a step: move the old one away
            _remove(directory)
        os.rename(tmp, directory)
    dist.barrier()


def _atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _remove(directory: str) -> None:
    """Rename first, so a crash mid-delete never leaves a partial dir under a real name."""
    trash = directory + ".deleting"
    os.rename(directory, trash)
    shutil.rmtree(trash)


def complete_checkpoints(save_root: str) -> list:
    """Complete checkpoint directories under save_root, oldest first."""
    if not os.path.isdir(save_root):
        return []
    names = sorted(d for d in os.listdir(save_root) if d.startswith("step_")
                   and d[5:].isdigit() and os.path.isfile(os.path.join(save_root, d,
                                                                       "state.json")))
    return [os.path.join(save_root, d) for d in names]


def resolve_checkpoint(load_path: str, save_root: str, run_dir: str):
    """The directory to resume from, or None for `latest` when nothing was saved yet."""
    if load_path == "latest":
        pointer = os.path.join(save_root, "latest")
        if os.path.isfile(pointer):
            with open(pointer) as f:
                candidate = os.path.join(save_root, f.read().strip())
            if os.path.isfile(os.path.join(candidate, "state.json")):
                return candidate
        found = complete_checkpoints(save_root)
        return found[-1] if found else None
    path = load_path if os.path.isabs(load_path) else os.path.join(run_dir, load_path)
    if not os.path.isfile(os.path.join(path, "state.json")):
        found = complete_checkpoints(save_root)
        raise CheckpointError(f"checkpoint.load_path='{load_path}' ({path}) is not a complete "
                              f"checkpoint (no state.json); complete ones under {save_root}: "
                              f"{[os.path.basename(d) for d in found] or 'none'}; or use "
                              f"'latest'")
    return path


def _check_model(saved: dict, model_cfg, directory: str) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this config {getattr(model_cfg, k)!r}"
             for k in SHAPE_FIELDS if saved.get(k) != getattr(model_cfg, k)]
    if diffs:
        raise CheckpointError(f"checkpoint {directory} was written by a model of another "
                              f"shape ({'; '.join(diffs)}); resume with the same model "
                              f"settings, or start a new run")


def resume(config, run_dir: str, model, optimizer, pgm, data) -> tuple:
    """(step, tokens seen) to continue from: checkpoint.load_path's, or (0, 0) when it is
    unset, or "latest" with nothing saved yet (so one command both starts and resumes)."""
    from picotron.data import check_data_state
    if not config.checkpoint.load_path:
        return 0, 0
    path = resolve_checkpoint(config.checkpoint.load_path, save_root(config, run_dir), run_dir)
    if path is None:
        return 0, 0
    state = load_checkpoint(path, model, optimizer, pgm, config, check=lambda s:
                            check_data_state(s["data"], config, s["step"], data))
    return state["step"], state["tokens_seen"]


def save_root(config, run_dir: str) -> str:
    return os.path.join(run_dir, config.checkpoint.save_dir)   # an absolute save_dir wins


def load_checkpoint(directory: str, model, optimizer, pgm, config, check=None) -> dict:
    """Load weights, optimizer state and RNG states; return the saved state (step, tokens
    seen, data position). Everything is read and checked (also by `check(state)`) before the
    model is touched, so a bad checkpoint leaves this run and the checkpoint as they were."""
    try:
        with open(os.path.join(directory, "state.json")) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {directory}/state.json ({e}); not a complete "
                              f"checkpoint") from None
    _check_model(state["config"]["model"], config.model, directory)
    if check is not None:
        check(state)
    shards = lambda kind: sorted(glob.glob(os.path.join(directory, f"{kind}-*.safetensors")))
    index = index_shards(shards("weights"), state["sha256"])
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
    opt_state = {}
    if optimizer is not None:
        files = shards("optimizer")
        opt_index = index_shards(files, state["sha256"])
        per_param = {k: v for f in files for k, v in (shard_metadata(f, "state") or {}).items()}
        for n, p in params:
            if per_param.get(n, {}).get("tensors"):
                opt_state["step"] = int(per_param[n]["scalars"]["step"])
                opt_state[p] = {key: read_slice(opt_index, f"{n}.{key}", slice_bounds(p))
                                for key in per_param[n]["tensors"]}
    rng_path = os.path.join(directory, f"rng-rank{pgm.global_rank}.pt")
    same_layout = state["layout"] == {k: getattr(pgm, f"{k}_size") for k in ("dp", "pp", "cp",
                                                                             "tp")}
    rng = torch.load(rng_path, weights_only=True) if same_layout and os.path.exists(
        rng_path) else None
    # ---- everything is read and checked: now change the run --------------------------------
    with torch.no_grad():
        for n, p in params:
            p.copy_(values[n])
    if optimizer is not None:
        optimizer.load_param_state(opt_state)   # moments and masters into this rank's shards
        if "loss_scale" in state:
            optimizer.scaler.load_state_dict(state["loss_scale"])
    if rng is not None:    # RNG streams belong to a rank: restored only in the same layout
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state
