"""Checkpoints: model weights in safetensors under layout-independent names.

Every rank that holds a distinct piece of the model (dp_rank 0, cp_rank 0: the other DP and
CP ranks hold copies) writes one file, `weights-pp{P}-tp{T}.safetensors`, with its local
tensors under their full-model names. The file's metadata records, for every tensor, the shape
of the full tensor and the slice of it this rank holds, so any layout (or one process) can
assemble full tensors or cut out its own slices. A parameter replicated across TP ranks is
written by tp_rank 0 only.

Writing is atomic: everything goes into `<dir>.tmp`, and one rank renames it to `<dir>` after
a barrier, so a half-written checkpoint never carries the final name.
"""
import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file


def _slice_bounds(param) -> list:
    """[[start, stop], ...] per dim of the full tensor that this rank's tensor covers."""
    full = list(getattr(param, "full_shape", param.shape))
    bounds = [[0, n] for n in full]
    for dim, s in enumerate(getattr(param, "local_slice", ())):
        if isinstance(s, slice):
            bounds[dim] = [s.start or 0, full[dim] if s.stop is None else s.stop]
    return bounds


def save_weights(model, pgm, directory: str) -> None:
    """Write this rank's share of the weights into `directory` (collective: all ranks call)."""
    tmp = directory + ".tmp"
    if pgm.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if pgm.dp_rank == 0 and pgm.cp_rank == 0:
        tensors, layout = {}, {}
        for name, p in model.named_parameters():
            if hasattr(p, "tied_name"):     # a pipeline copy of a tied weight: saved once,
                continue                    # under its own name, by the first stage
            sharded = hasattr(p, "local_slice")
            if sharded or pgm.tp_rank == 0:
                tensors[name] = p.detach().cpu().contiguous()
                layout[name] = {"full_shape": list(getattr(p, "full_shape", p.shape)),
                                "bounds": _slice_bounds(p)}
        if tensors:
            save_file(tensors, os.path.join(tmp, f"weights-pp{pgm.pp_rank}-tp{pgm.tp_rank}"
                                                 f".safetensors"),
                      metadata={"layout": json.dumps(layout)})
    dist.barrier()
    if pgm.global_rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.rename(tmp, directory)
    dist.barrier()


def load_full_weights(directory: str) -> dict:
    """{name: full tensor} assembled from every shard file in `directory`."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in checkpoint {directory}")
    full = {}
    for fname in files:
        with safe_open(os.path.join(directory, fname), "pt") as f:
            layout = json.loads(f.metadata()["layout"])
            for name in f.keys():
                spec = layout[name]
                tensor = f.get_tensor(name)
                if name not in full:
                    full[name] = torch.empty(spec["full_shape"], dtype=tensor.dtype)
                index = tuple(slice(a, b) for a, b in spec["bounds"])
                full[name][index] = tensor
    return full
