"""Safetensors shard files that any layout can read: each tensor is a slice of a full tensor.

A shard's metadata "layout" maps every tensor name to {"full_shape": [...], "bounds":
[[start, stop], ...]}: the piece of the full tensor the file holds. A reader indexes all
shards, then cuts out the slice *it* needs from whichever pieces overlap it, so a checkpoint
written with tp=2 loads with tp=1 or tp=4 (and a Hugging Face file is the special case of one
piece covering the whole tensor).
"""
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from picotron.utils import readable_as_usual, sha256


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; nothing has been modified."""


class SharedCheckpointError(CheckpointError):
    """A CheckpointError that every rank raises alike: decided from files all of them read
    (state.json, a config) or agreed by a collective, so it is said once, not once per
    rank."""


def slice_bounds(param) -> list:
    """[[start, stop], ...] per dim of the full tensor that this rank's tensor covers."""
    full = list(getattr(param, "full_shape", param.shape))
    bounds = [[0, n] for n in full]
    for dim, s in enumerate(getattr(param, "local_slice", ())):
        if isinstance(s, slice):
            bounds[dim] = [s.start or 0, full[dim] if s.stop is None else s.stop]
    return bounds


def write_shard(path: str, tensors: dict, layout: dict, extra: dict = None) -> str:
    """Write one safetensors file with its layout (and `extra` JSON metadata); its sha256."""
    meta = {"layout": json.dumps(layout), **{k: json.dumps(v) for k, v in (extra or {}).items()}}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path, meta)
    readable_as_usual(path)
    return sha256(path)


def _open(path: str):
    try:
        return safe_open(path, "pt")
    except Exception as e:       # truncated file, garbage header, not safetensors at all
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                              f"{e}); the checkpoint is corrupt: resume from another one"
                              ) from None


def index_shards(paths: list) -> dict:
    """{name: [(path, bounds, full_shape, key in the file), ...]} over the given shard files.

    A file without a "layout" (Hugging Face's) holds whole tensors. A checkpoint's files are
    verified as a whole before they are indexed (picotron/checkpoint/verify.py)."""
    index = {}
    for path in paths:
        with _open(path) as f:
            meta = f.metadata() or {}
            layout = json.loads(meta["layout"]) if "layout" in meta else None
            for name in f.keys():
                if layout is not None:
                    spec = layout[name]
                    full, bounds = spec["full_shape"], spec["bounds"]
                else:
                    full = list(f.get_slice(name).get_shape())
                    bounds = [[0, n] for n in full]
                index.setdefault(name, []).append((path, bounds, full, name))
    return index


def shard_metadata(path: str, key: str):
    """One JSON value of a shard's metadata (None when absent)."""
    with _open(path) as f:
        value = (f.metadata() or {}).get(key)
    return None if value is None else json.loads(value)


def read_slice(index: dict, name: str, bounds: list, dtype=None) -> torch.Tensor:
    """The part [bounds] of full tensor `name`, assembled from every overlapping piece."""
    shape = [b - a for a, b in bounds]
    numel = int(torch.Size(shape).numel())
    out, covered = None, 0
    for path, piece, _, key in index[name]:
        lo = [max(a, p) for (a, _), (p, _) in zip(bounds, piece)]
        hi = [min(b, q) for (_, b), (_, q) in zip(bounds, piece)]
        if any(l >= h for l, h in zip(lo, hi)):
            continue                                          # no overlap
        with _open(path) as f:
            try:
                part = f.get_slice(key)[tuple(slice(l - p, h - p) for l, h, (p, _)
                                               in zip(lo, hi, piece))]
            except Exception as e:
                raise CheckpointError(f"{path}: reading '{name}' failed ({type(e).__name__}: "
                                      f"{e}); the file is corrupt") from None
        if out is None:
            out = torch.empty(shape, dtype=dtype or part.dtype)
        out[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, bounds))] = part
        covered += part.numel()
    if covered != numel:
        raise CheckpointError(f"the shards cover {covered} of the {numel} values of '{name}' "
                              f"this rank needs; the checkpoint is incomplete")
    return out


def load_full_weights(directory: str) -> dict:
    """{name: full tensor} assembled from every weight shard in `directory`."""
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory)
                   if f.startswith("weights-") and f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no weights-*.safetensors files in checkpoint {directory}")
    index = index_shards(files)
    return {name: read_slice(index, name, [[0, n] for n in pieces[0][2]])
            for name, pieces in index.items()}


def checkpoint_config(directory: str):
    """The Config a checkpoint was trained with (from its state.json), for reading its weights:
    where the run's first weights came from (checkpoint.init_from) is not checked, since the
    checkpoint holds its own (that folder may have moved since), and neither is its
    dataset.tokenizer: it is kept as saved, and a reader that needs it loads it then (and
    says how to replace it if it moved)."""
    from picotron.config import config_from_dict
    try:
        with open(os.path.join(directory, "state.json")) as f:
            raw = json.load(f)["config"]
        tokenizer = None
        if isinstance(raw, dict) and isinstance(raw.get("checkpoint"), dict):
            raw["checkpoint"]["init_from"] = None
        if isinstance(raw, dict) and isinstance(raw.get("dataset"), dict):
            tokenizer = raw["dataset"].pop("tokenizer", None)
        config = config_from_dict(raw)
        config.dataset.tokenizer = tokenizer
        return config
    except OSError as e:
        raise CheckpointError(f"{directory} is not a complete checkpoint ({e}); give a "
                              f"step_* directory that holds a state.json") from None
