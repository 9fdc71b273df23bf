"""Writing a checkpoint in two halves: a snapshot on the main thread, then only files.

`take_snapshot` runs on every rank at the step boundary, on the main thread: the collectives
(ZeRO's gather of the optimizer shards, delayed FP8's amaxes, the barrier after rank 0 makes
`<dir>.tmp`) and, for a background save, the copies of this rank's tensors to host memory
(HostBuffers) all happen here, so training may change the parameters as soon as it returns.
`write_snapshot` then touches only files, never a process group, so it can run on a
background thread (picotron/checkpoint/async_save.py):
1. this rank's shards and its RNG state into `<dir>.tmp`, then a marker `.done-rank{R}.json`
   holding their sha256 (or `.failed-rank{R}.json` with the error);
2. rank 0 waits for every rank's marker, merges the manifests, deletes the markers, writes
   state.json (with its own checksum) last, renames `<dir>.tmp` to `<dir>`, points `latest`
   at it and prunes beyond `keep_last`. A save killed part-way leaves a `.tmp` directory,
   which is never loaded.
"""
import contextlib
import glob
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from picotron.checkpoint.verify import (FORMAT_VERSION, STATE_FILE, state_checksum, step_names)
from picotron.checkpoint.shards import (CheckpointError, SharedCheckpointError, slice_bounds,
                                        write_shard)


@dataclass
class Snapshot:
    """Everything one rank writes for one checkpoint, already in host memory."""
    directory: str
    rank: int
    world: int
    keep_last: int
    timeout_s: float
    shards: dict = field(default_factory=dict)    # file name -> (tensors, layout, extra)
    state: dict = None                            # rank 0 only: state.json without checksums


class HostBuffers:
    """Where a snapshot keeps the step's tensors. For a save written right away, the live
    tensors themselves: nothing changes them before the files are written, and no host memory
    is held between saves. For one written in the background, copies: in pinned memory on a
    GPU (a fast copy; allocating pinned memory is slow, so the buffers stay from one save to
    the next: host memory the size of this rank's shards), a clone on the CPU."""

    def __init__(self, copies: bool):
        self.copies, self.pinned = copies, {}

    def keep(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if not self.copies:
            return tensor
        if tensor.device.type == "cpu":
            return tensor.clone(memory_format=torch.contiguous_format)
        buf = self.pinned.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self.pinned[key] = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                 pin_memory=True)
        return buf.copy_(tensor, non_blocking=True)


def _owned(model, pgm):
    """(name, param) pairs this rank writes: distinct pieces only. The other DP and CP ranks
    hold copies; a TP-replicated parameter is written by tp_rank 0; a pipeline copy of a tied
    weight (`tied_name`) is saved once, by stage 0."""
    if pgm.dp_rank != 0 or pgm.cp_rank != 0:
        return []
    return [(n, p) for n, p in model.named_parameters()
            if (hasattr(p, "local_slice") or pgm.tp_rank == 0) and not hasattr(p, "tied_name")]


def _shards(model, opt_state, pgm, buffers) -> dict:
    """This rank's weight (and optimizer) shards: {file name: (tensors, layout, extra)}.
    Weights and moments are stored under full-model names with the slice each file holds;
    the optimizer's scalar state (its step count) goes in the metadata, keyed by name."""
    owned = _owned(model, pgm)
    if not owned:
        return {}
    tag = f"pp{pgm.pp_rank}-tp{pgm.tp_rank}"
    layout = {n: {"full_shape": list(getattr(p, "full_shape", p.shape)),
                  "bounds": slice_bounds(p)} for n, p in owned}
    out = {f"weights-{tag}.safetensors": ({n: buffers.keep(n, p) for n, p in owned},
                                          layout, None)}
    if opt_state is not None:
        tensors, opt_layout, per_param = {}, {}, {}
        for name, p in owned:
            entry = per_param[name] = {"scalars": {"step": opt_state["step"]}, "tensors": []}
            for key, value in opt_state.get(p, {}).items():      # moments (and master): like p
                tensors[f"{name}.{key}"] = buffers.keep(f"{name}.{key}", value)
                opt_layout[f"{name}.{key}"] = layout[name]
                entry["tensors"].append(key)
        out[f"optimizer-{tag}.safetensors"] = (tensors, opt_layout, {"state": per_param})
    return out


def _rng_shard(pgm) -> dict:
    """This rank's RNG states as tensors (torch, each CUDA device) and JSON (Python's)."""
    version, words, gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():     # a CPU run never starts CUDA (not even to ask)
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return {f"rng-rank{pgm.global_rank}.safetensors": (
        tensors, {k: {"full_shape": list(v.shape), "bounds": [[0, len(v)]]}
                  for k, v in tensors.items()}, {"python": [version, list(words), gauss]})}


def _fp8_amaxes(model, config, pgm):
    """Collective. Under delayed FP8 scaling: every site's amax for the next step
    (speed/fp8/delayed.py: rolled over the ranks that share the site, gathered from the
    pipeline stages) by name, `dy_scale`, dp x cp, the factor between a rank's output
    gradients and one process's (which a resume in another layout divides out), and the
    saturation guard's `rolls_since_saturation` (the same on every rank; None: no cast yet);
    else None."""
    if config.training.fp8 != "tensorwise_delayed":
        return None
    ledger = getattr(model, "fp8_ledger", None)
    mine = ((ledger.rolled_amaxes(), ledger.rolls_since_saturation()) if ledger is not None
            else ({}, None))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    rolls = [r for _, r in parts if r is not None]
    return {"dy_scale": pgm.dp_size * pgm.cp_size,
            "amaxes": {name: value for part, _ in parts for name, value in part.items()},
            "rolls_since_saturation": min(rolls) if rolls else None}


def take_snapshot(model, optimizer, pgm, config, save_root: str, step: int, state: dict,
                  buffers: HostBuffers) -> Snapshot:
    """Collective. `state`: tokens_seen, data (the data position), accepted_changes."""
    directory = os.path.join(save_root, f"step_{step:06d}")
    snap = Snapshot(directory, pgm.global_rank, dist.get_world_size(),
                    config.checkpoint.keep_last, config.distributed.timeout_s)
    # Collective under ZeRO (the optimizer shards are gathered), so every rank computes it.
    opt_state = optimizer.param_state() if optimizer is not None else None
    _refuse_non_finite(_owned(model, pgm), opt_state or {}, directory)   # never a NaN latest
    _make_tmp_directory(directory, pgm.global_rank)
    if pgm.global_rank == 0:
        snap.state = {"format_version": FORMAT_VERSION, "step": step, **state,
                      "layout": {k: getattr(pgm, f"{k}_size") for k in ("dp", "pp", "cp",
                                                                        "tp")},
                      "config": config.to_dict()}
        if optimizer is not None:
            snap.state["loss_scale"] = optimizer.scaler.state_dict()
    snap.shards = {**_shards(model, opt_state, pgm, buffers), **_rng_shard(pgm)}
    amaxes = _fp8_amaxes(model, config, pgm)
    if amaxes is not None and snap.state is not None:
        snap.state["fp8_amaxes"] = amaxes
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()        # the pinned copies have landed: training may go on
    return snap


def _refuse_non_finite(owned, opt_state: dict, directory: str) -> None:
    """Collective: a checkpoint of weights or optimizer moments holding a NaN or an infinity
    (a diverged run, an fp16 overflow that reached the weights) is not written, so `latest`
    keeps pointing at the last good one; every rank stops with one message naming it."""
    bad = None
    for name, p in owned:
        tensors = [(name, p)] + [(f"{name} (optimizer {key})", value)
                                 for key, value in opt_state.get(p, {}).items()]
        bad = next((n for n, t in tensors if not bool(torch.isfinite(t).all())), None)
        if bad:
            break
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, bad)
    if any(found):
        rank, name = next((r, n) for r, n in enumerate(found) if n)
        latest = os.path.join(os.path.dirname(directory), "latest")
        kept = open(latest).read().strip() if os.path.isfile(latest) else None
        raise SharedCheckpointError(
            f"not saving {directory}: {name} holds non-finite values (NaN or inf; rank "
            f"{rank}), the model has diverged. `latest` stays "
            f"{kept + ', the last good checkpoint' if kept else 'unset: no good checkpoint'}; "
            f"resume from it with a lower training.learning_rate (or bfloat16 for float16)")


def _make_tmp_directory(directory: str, rank: int) -> None:
    """Collective: rank 0 makes `<dir>.tmp` (removing a killed save's debris) and tells every
    rank whether it could (a save root deleted during the run is made again). One that a file
    replaced, that filled up or turned read-only then stops every rank with one message,
    instead of a traceback on rank 0 and the other ranks left waiting in the next collective."""
    problem = None
    if rank == 0:
        shutil.rmtree(directory + ".tmp", ignore_errors=True)
        try:
            os.makedirs(directory + ".tmp")
        except OSError as e:
            problem = f"{type(e).__name__}: {e.strerror or e}"
    said = [problem]
    dist.broadcast_object_list(said, src=0)     # also the barrier: <dir>.tmp exists after it
    if said[0] is not None:
        raise SharedCheckpointError(
            f"could not start checkpoint {directory} ({said[0]}); the checkpoints before it "
            f"are intact: make {os.path.dirname(directory)} a writable directory with free "
            f"space (or set checkpoint.save_dir), then resume with --set "
            f"checkpoint.load_path=latest")


def write_snapshot(snap: Snapshot) -> None:
    """Write this rank's files; on rank 0, then finish the checkpoint. Files only."""
    tmp = snap.directory + ".tmp"
    marker = os.path.join(tmp, f".done-rank{snap.rank}.json")
    try:
        sums = {name: write_shard(os.path.join(tmp, name), tensors, layout, extra)
                for name, (tensors, layout, extra) in snap.shards.items()}
    except Exception as e:     # tell rank 0, which would otherwise wait for this rank
        with contextlib.suppress(OSError):
            atomic_write(os.path.join(tmp, f".failed-rank{snap.rank}.json"),
                         json.dumps(f"{type(e).__name__}: {e}"))
        raise
    atomic_write(marker, json.dumps(sums))
    if snap.rank == 0:
        _finish(snap)


def _finish(snap: Snapshot) -> None:
    """Rank 0: wait for every rank's files, then state.json last, rename, `latest`, prune."""
    tmp, sums = snap.directory + ".tmp", {}
    waiting = set(range(snap.world))
    deadline = time.monotonic() + snap.timeout_s
    while waiting:
        if not os.path.isdir(tmp):      # its ranks could not even say they failed
            raise CheckpointError(f"{tmp} was removed while the checkpoint was being written")
        for r in sorted(waiting):
            failed = os.path.join(tmp, f".failed-rank{r}.json")
            if os.path.exists(failed):
                with open(failed) as f:
                    raise CheckpointError(f"rank {r} could not write its part of "
                                          f"{snap.directory}: {json.load(f)}")
            done = os.path.join(tmp, f".done-rank{r}.json")
            if os.path.exists(done):
                with open(done) as f:
                    sums.update(json.load(f))
                os.remove(done)
                waiting.discard(r)
        if waiting and time.monotonic() > deadline:
            raise CheckpointError(f"ranks {sorted(waiting)} did not finish writing "
                                  f"{snap.directory} within distributed.timeout_s="
                                  f"{snap.timeout_s}")
        if waiting:
            time.sleep(0.02)
    state = dict(snap.state, sha256=sums)
    state["state_sha256"] = state_checksum(state)
    atomic_write(os.path.join(tmp, STATE_FILE), json.dumps(state, indent=1))  # complete now
    if os.path.exists(snap.directory):              # re-saving a step: move the old one away
        remove_checkpoint(snap.directory)
    os.rename(tmp, snap.directory)
    save_root = os.path.dirname(snap.directory)
    atomic_write(os.path.join(save_root, "latest"), os.path.basename(snap.directory) + "\n")
    if snap.keep_last:     # the one just written, and the newest keep_last - 1 others by step
        others = [d for d in step_names(save_root) if d != os.path.basename(snap.directory)
                  and os.path.isdir(os.path.join(save_root, d))]     # never a user's file
        for old in others[:max(0, len(others) - (snap.keep_last - 1))]:
            try:           # the save is complete and latest: a failed prune only warns
                remove_checkpoint(os.path.join(save_root, old))
            except OSError as e:
                print(f"warning: checkpoint.keep_last={snap.keep_last}: could not remove "
                      f"{os.path.join(save_root, old)} ({type(e).__name__}: {e}); remove it "
                      f"by hand", file=sys.stderr, flush=True)
    for debris in glob.glob(os.path.join(save_root, "step_*.tmp")) + glob.glob(
            os.path.join(save_root, "step_*.deleting")):      # left by earlier crashes
        shutil.rmtree(debris, ignore_errors=True)


def atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def remove_checkpoint(directory: str) -> None:
    """Rename first, so a crash mid-delete never leaves a partial dir under a real name."""
    if not os.path.isdir(directory):    # a file someone put under a checkpoint's name
        raise CheckpointError(f"{directory} is a file, where the checkpoint of that step goes; "
                              f"move it away")
    trash = directory + ".deleting"
    os.rename(directory, trash)
    shutil.rmtree(trash)
