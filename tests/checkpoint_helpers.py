"""A tiny one-process training to checkpoint, and ways to edit what it saved, for the
checkpoint tests (in-process: one gloo rank, no launch)."""
import json
import os

import torch

from tiny import one_process_group
from picotron.checkpoint.checkpoint import save_checkpoint
from picotron.checkpoint.verify import state_checksum
from picotron.config import Config
from picotron.data.windows import data_state
from picotron.data_parallel import DistributedAdamW, GradBuckets
from picotron.loss import causal_lm_loss
from picotron.model import Decoder, materialize


class Windows:
    """Stands in for the training data: only its number of windows matters to a checkpoint."""

    def __init__(self, num_windows: int):
        self.num_windows = num_windows


def tiny_config() -> Config:
    config = Config()
    m = config.model
    m.hidden_size, m.intermediate_size, m.num_hidden_layers = 32, 64, 1
    config.training.dtype, config.distributed.use_cpu = "float32", True
    return config


def build(config, seed: int = 0):
    """(model, grads, optimizer) with weights drawn from `seed`."""
    pgm = one_process_group()
    with torch.device("meta"):
        model = Decoder(config.model)
    model = materialize(model, seed, torch.device("cpu"), torch.float32)
    grads = GradBuckets(model, pgm, config)
    return model, grads, DistributedAdamW(grads, pgm, config)


def train_one(model, grads, opt, step: int) -> None:
    """One optimizer step on a batch drawn from `step`."""
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(step))
    grads.sync = True
    causal_lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    grads.finish()
    opt.step(1e-3)
    grads.zero_grad()


def step_state(config, step: int, windows=None, tokens=None, history=()) -> dict:
    """What train.py hands a save after `step` uninterrupted steps (unless told otherwise)."""
    windows = windows or Windows(1000)
    if tokens is None:
        tokens = step * config.global_batch_size * config.training.seq_length
    return {"tokens_seen": tokens, "data": data_state(config, step, windows),
            "accepted_changes": list(history)}


def save_at(model, opt, config, root: str, step: int, **state) -> str:
    return save_checkpoint(model, opt, one_process_group(), config, root, step,
                           step_state(config, step, **state))


def rewrite_state(directory: str, edit, rehash: bool = True) -> None:
    """Apply `edit(state)` to a checkpoint's state.json; `rehash`: update its checksum too,
    as if it had been written that way."""
    path = os.path.join(directory, "state.json")
    with open(path) as f:
        state = json.load(f)
    edit(state)
    if rehash:
        state["state_sha256"] = state_checksum(state)
    with open(path, "w") as f:
        json.dump(state, f)


def weights_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def content_of(directory: str) -> dict:
    """{file: (tensors, metadata)} of every safetensors file and the state without its
    checksums: what a checkpoint holds. (Bytes differ between processes: safetensors writes
    the metadata keys in hash order.)"""
    from safetensors import safe_open
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == "state.json":
            with open(path) as f:
                state = json.load(f)
            state.pop("state_sha256"), state.pop("sha256")
            out[name] = state
        else:
            with safe_open(path, "pt") as f:
                out[name] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    return out


def same_content(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a.get("state.json") != b.get("state.json"):
        return False
    for name in a:
        if name != "state.json":
            (ta, ma), (tb, mb) = a[name], b[name]
            if ma != mb or ta.keys() != tb.keys() or not all(
                    ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta):
                return False
    return True
