"""Checkpoints: a resumed run continues the uninterrupted one exactly, a save killed part-way
is never the latest, keep_last prunes, and bad input fails clearly without touching any
checkpoint."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from launch import ROOT, final_weights, launch_script, read_metrics, write_config
from tiny import documents, one_process_group
from picotron.checkpoint.checkpoint import (CheckpointError, complete_checkpoints, load_checkpoint,
                                            resolve_checkpoint, save_checkpoint)
from picotron.config import Config
from picotron.data.windows import data_state
from picotron.data_parallel import DistributedAdamW, GradBuckets
from picotron.model import Decoder, materialize
from picotron.checkpoint.shards import index_shards

TINY = ["--num_hidden_layers", "2", "--seq_len", "32", "--set", "model.hidden_size=32",
        "--set", "model.intermediate_size=64", "--set", "model.num_attention_heads=4",
        "--set", "model.num_key_value_heads=2", "--set", "training.warmup_steps=2"]
TRAIN = os.path.join(ROOT, "train.py")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """8 steps on dp=2 gloo from a local jsonl file, validation every 2 steps, a checkpoint
    every 2 steps of which the last 3 are kept. The global batch (8) crosses epochs."""
    root = tmp_path_factory.mktemp("ckpt")
    src = str(root / "docs.jsonl")
    with open(src, "w") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in documents(30)))
    path = write_config(root, "a", TINY + [
        "--dp", "2", "--mbs", "2", "--grad_acc_steps", "2", "--total_train_steps", "8",
        "--dataset_name", src, "--set", "dataset.val_samples=4",
        "--set", "training.val_frequency=2", "--set", "checkpoint.save_frequency=2",
        "--set", "checkpoint.keep_last=3"])
    launch_script(TRAIN, 2, ["--config", path])
    return path


def test_keep_last_and_latest(reference_run):
    save_root = os.path.join(os.path.dirname(reference_run), "checkpoints")
    assert sorted(os.listdir(save_root)) == ["latest", "step_000004", "step_000006",
                                             "step_000008"]
    assert resolve_checkpoint("latest", save_root, "/") == os.path.join(save_root,
                                                                        "step_000008")


def test_resume_at_half_matches_the_uninterrupted_run(reference_run, tmp_path):
    """The stopped run is what is on disk after step 4: its config and its step-4
    checkpoint. Resuming it with load_path=latest must give the same loss at every later step,
    the same validation losses and the same final weights."""
    run_a = os.path.dirname(reference_run)
    run_b = tmp_path / "b"
    os.makedirs(run_b / "checkpoints")
    shutil.copytree(os.path.join(run_a, "checkpoints", "step_000004"),
                    run_b / "checkpoints" / "step_000004")
    with open(reference_run) as f:
        raw = json.load(f)
    raw["checkpoint"]["load_path"] = "latest"
    with open(run_b / "config.json", "w") as f:
        json.dump(raw, f)
    proc = launch_script(TRAIN, 2, ["--config", str(run_b / "config.json")])
    assert "resumed at step 4" in proc.stdout
    a, b = read_metrics(reference_run), read_metrics(str(run_b / "config.json"))
    key = lambda r: (r["step"], "val_loss" in r)                              # noqa: E731
    a = {key(r): r for r in a if r["step"] > 4}
    assert sorted(a) == sorted(key(r) for r in b)        # steps 5..8 and val at 6, 8
    for r in b:
        ref = a[key(r)]
        name = "val_loss" if "val_loss" in r else "loss"
        assert abs(r[name] - ref[name]) <= 1e-6, (r, ref)
        assert r.get("tokens") == ref.get("tokens")
    wa, wb = final_weights(reference_run), final_weights(str(run_b / "config.json"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


KILLER = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import picotron.checkpoint.checkpoint as ck
import picotron.checkpoint.write as ck_write
from tiny import one_process_group
from picotron.config import Config
from picotron.data.windows import data_state
from picotron.data_parallel import DistributedAdamW, GradBuckets
from picotron.loss import causal_lm_loss
from picotron.model import Decoder, materialize
config = Config()
config.model.hidden_size, config.model.intermediate_size, config.model.num_hidden_layers = 32, 64, 1
pgm = one_process_group()
with torch.device("meta"):
    model = Decoder(config.model)
model = materialize(model, 0, torch.device("cpu"), torch.float32)
grads = GradBuckets(model, pgm, config)
opt = DistributedAdamW(grads, pgm, config)
x = torch.randint(0, 256, (2, 9))
for step in (1, 2):
    grads.sync = True
    causal_lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    grads.finish()
    opt.step(1e-3)
    grads.zero_grad()
    if step == 2:        # die like kill -9: {where}
        if {where!r} == "shard":
            real = ck_write.write_shard
            ck_write.write_shard = lambda *a, **k: (real(*a, **k), os.kill(os.getpid(), 9))
        else:
            ck.os.rename = lambda *a: os.kill(os.getpid(), 9)
    ck.save_checkpoint(model, opt, pgm, config, {save_root!r}, step,
                       {{"tokens_seen": step * 8 * 256, "data": data_state(config, step, None)}})
"""


@pytest.mark.parametrize("where", ["shard", "rename"])
def test_a_save_killed_part_way_is_never_latest(tmp_path, where):
    save_root = str(tmp_path / "checkpoints")
    code = KILLER.format(root=ROOT, tests=os.path.join(ROOT, "tests"), where=where,
                         save_root=save_root)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert os.path.isdir(os.path.join(save_root, "step_000002.tmp"))    # really part-way
    latest = resolve_checkpoint("latest", save_root, str(tmp_path))
    assert latest == os.path.join(save_root, "step_000001")
    assert complete_checkpoints(save_root) == [latest]
    config = Config()
    config.model.hidden_size, config.model.intermediate_size = 32, 64
    config.model.num_hidden_layers = 1
    with torch.device("meta"):
        model = Decoder(config.model)
    model = materialize(model, 1, torch.device("cpu"), torch.float32)
    pgm = one_process_group()
    opt = DistributedAdamW(GradBuckets(model, pgm, config), pgm, config)
    state = load_checkpoint(latest, model, opt, pgm, config)
    assert state["step"] == 1 and state["tokens_seen"] == 8 * 256
    steps = [int(s["step"]) for o in opt.optimizers for s in o.state.values()]
    assert steps and all(n == 1 for n in steps)
    # The next save of that step replaces the debris and becomes the latest.
    save_checkpoint(model, opt, pgm, config, save_root, 2,
                    {"tokens_seen": 2 * 8 * 256, "data": data_state(config, 2, None)})
    assert resolve_checkpoint("latest", save_root, str(tmp_path)).endswith("step_000002")
    assert not [d for d in os.listdir(save_root) if d.endswith(".tmp")]


def test_a_truncated_shard_is_a_checkpoint_error(tmp_path):
    from safetensors.torch import save_file
    path = str(tmp_path / "weights-pp0-tp0.safetensors")
    save_file({"w": torch.ones(64, 64)}, path)
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        index_shards([path])


def tree_digest(path: str) -> dict:
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), path)] = hashlib.sha256(
                    f.read()).hexdigest()
    return out


@pytest.mark.parametrize("case", ["text_column", "model_shape", "corrupt_weights", "seed"])
def test_bad_input_fails_clearly_and_touches_no_checkpoint(reference_run, tmp_path, case):
    """Rerun a copy of the finished run with one thing wrong and load_path=latest."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(reference_run), run)
    with open(run / "config.json") as f:
        raw = json.load(f)
    raw["checkpoint"]["load_path"] = "latest"
    raw["training"]["total_train_steps"] = 12
    raw["distributed"]["dp_size"] = 1                 # one process, same global batch (8)
    raw["training"]["gradient_accumulation_steps"] = 4
    if case == "text_column":
        raw["dataset"]["text_column"], expected = "body", "has no column 'body'"
    elif case == "seed":
        raw["training"]["seed"] += 1
        expected = (f"training.seed: checkpoint {raw['training']['seed'] - 1}, this config "
                    f"{raw['training']['seed']} (the data order follows the seed)")
    elif case == "model_shape":
        raw["model"]["hidden_size"], expected = 64, "hidden_size: checkpoint 32, this config 64"
    else:
        shard = run / "checkpoints" / "step_000008" / "weights-pp0-tp0.safetensors"
        data = bytearray(shard.read_bytes())
        data[-10:] = b"\xff" * 10
        shard.write_bytes(bytes(data))
        # named explicitly: refused (with "latest" an older checkpoint would be resumed)
        raw["checkpoint"]["load_path"] = "checkpoints/step_000008"
        expected = "weights-pp0-tp0.safetensors: does not match the sha256"
    with open(run / "config.json", "w") as f:
        json.dump(raw, f)
    before = tree_digest(str(run))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                           str(run / "config.json")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    after = tree_digest(str(run))
    assert {k: v for k, v in after.items() if not k.startswith("data_cache")} == \
        {k: v for k, v in before.items() if not k.startswith("data_cache")}
