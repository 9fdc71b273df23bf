"""A checkpoint is trusted only as a whole, and a resume never silently changes the run.

In one process: every file is in the manifest and nothing is a pickle; a missing, unlisted or
damaged file, or a damaged or inconsistent state.json, is refused by name before anything is
loaded; `latest` skips (and names) a bad checkpoint while an explicitly named one is refused;
another seed, dataset, batch or sequence length is refused unless `checkpoint.allow_changes`
accepts it, and then recorded; another model shape always is. The 4-rank cases are in
tests/test_checkpoint_ranks.py; async saving in tests/test_async_save.py."""
import json
import os
import random
import shutil

import pytest
import torch

from checkpoint_helpers import (build, rewrite_state, save_at, tiny_config, train_one,
                                weights_of, Windows)
from tiny import one_process_group
from picotron.checkpoint.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, resume
from picotron.checkpoint.changes import DATASET_FIELDS, run_changes
from picotron.checkpoint.verify import read_state
from picotron.config import ConfigError, config_from_dict
from picotron.config.checks import RESUME_CHANGES


@pytest.fixture()
def saved(tmp_path):
    """A run of one process after 1, 2 and 3 steps: three checkpoints under tmp/checkpoints."""
    config = tiny_config()
    model, grads, opt = build(config)
    for step in (1, 2, 3):
        train_one(model, grads, opt, step)
        save_at(model, opt, config, str(tmp_path / "checkpoints"), step)
    return config, str(tmp_path / "checkpoints")


def test_every_file_is_listed_and_nothing_is_unpickled(saved, monkeypatch):
    config, root = saved
    step3 = os.path.join(root, "step_000003")
    with open(os.path.join(step3, "state.json")) as f:
        state = json.load(f)
    assert sorted(os.listdir(step3)) == sorted(list(state["sha256"]) + ["state.json"])
    assert "rng-rank0.safetensors" in state["sha256"]
    expected_python, expected_torch = random.getstate(), torch.get_rng_state()
    random.seed(123)
    torch.manual_seed(123)

    def no_pickle(*a, **k):
        raise AssertionError("a checkpoint was unpickled")
    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr("pickle.load", no_pickle)
    monkeypatch.setattr("pickle.loads", no_pickle)
    model, _, opt = build(config, seed=9)
    load_checkpoint(step3, model, opt, one_process_group(), config)
    assert random.getstate() == expected_python            # restored from safetensors/JSON
    assert torch.equal(torch.get_rng_state(), expected_torch)


def damage(directory: str, case: str):
    """Damage a copy of a checkpoint as `case` says; the message the refusal must contain."""
    path = lambda name: os.path.join(directory, name)                        # noqa: E731
    if case == "optimizer file deleted":
        os.remove(path("optimizer-pp0-tp0.safetensors"))
        return "optimizer-pp0-tp0.safetensors: listed in state.json but missing"
    if case == "entry removed, then the file flipped":
        rewrite_state(directory, lambda s: s["sha256"].pop("weights-pp0-tp0.safetensors"),
                      rehash=False)
        flip(path("weights-pp0-tp0.safetensors"))
        return "does not match the checksum it was written with"
    if case == "entry removed and rehashed, file deleted":
        rewrite_state(directory, lambda s: s["sha256"].pop("optimizer-pp0-tp0.safetensors"))
        os.remove(path("optimizer-pp0-tp0.safetensors"))
        return ("optimizer-pp0-tp0.safetensors: the saved layout writes this file, but "
                "state.json's manifest does not list it")
    if case == "extra unlisted shard":
        shutil.copy(path("weights-pp0-tp0.safetensors"), path("weights-pp0-tp1.safetensors"))
        return "weights-pp0-tp1.safetensors: not listed in state.json's manifest"
    if case in ("rng truncated", "rng random bytes"):
        data = open(path("rng-rank0.safetensors"), "rb").read()
        data = data[:len(data) // 2] if case == "rng truncated" else os.urandom(len(data))
        open(path("rng-rank0.safetensors"), "wb").write(data)
        return "rng-rank0.safetensors: does not match the sha256 recorded"
    if case == "weights flipped":
        flip(path("weights-pp0-tp0.safetensors"))
        return "weights-pp0-tp0.safetensors: does not match the sha256 recorded"
    raise ValueError(case)


def flip(path: str):
    data = bytearray(open(path, "rb").read())
    data[-5:] = bytes(255 - b for b in data[-5:])
    open(path, "wb").write(bytes(data))


STATE_CASES = {   # edit of state.json (then rehashed: "written wrong, consistently") -> message
    "a JSON list": ("list", "holds a JSON list, not the object"),
    "no sha256": (lambda s: s.pop("sha256"), "field 'sha256' is missing"),
    "no config": (lambda s: s.pop("config"), "field 'config' is missing"),
    "tokens_seen -5": (lambda s: s.update(tokens_seen=-5), "'tokens_seen' must be >= 0"),
    "step a string": (lambda s: s.update(step="3"), "'step' must be int, got '3'"),
    "step and position moved together": (
        lambda s: (s.update(step=2), s["data"].update(next_sample=16)),
        "field 'step' is 2 in a directory named step_000003"),
    "manifest entry not a sha": (lambda s: s["sha256"].update({"x.safetensors": 5}),
                                 "field 'sha256' has entries that are not"),
    "older format": (lambda s: s.update(format_version=1), "has format_version 1"),
    "config seed a string": (lambda s: s["config"]["training"].update(seed="42"),
                             "field 'config.training.seed' must be int, got '42'"),
    "no model section": (lambda s: s["config"].pop("model"),
                         "field 'config.model.vocab_size' is missing"),
    "not rehashed": (None, "does not match the checksum it was written with"),
    "no self checksum": ("drop", "field 'state_sha256' is missing"),
}


@pytest.mark.parametrize("case", ["optimizer file deleted", "entry removed, then the file "
                                  "flipped", "entry removed and rehashed, file deleted",
                                  "extra unlisted shard", "rng truncated", "rng random bytes",
                                  "weights flipped"] + [f"state: {k}" for k in STATE_CASES])
def test_a_damaged_checkpoint_is_refused_by_name_and_changes_nothing(saved, tmp_path, case):
    config, root = saved
    bad = str(tmp_path / "bad" / "step_000003")
    shutil.copytree(os.path.join(root, "step_000003"), bad)
    if case.startswith("state: "):
        edit, expected = STATE_CASES[case[7:]]
        if edit is None:
            rewrite_state(bad, lambda s: s.update(tokens_seen=s["tokens_seen"] + 1),
                          rehash=False)
        elif edit == "drop":
            rewrite_state(bad, lambda s: s.pop("state_sha256"), rehash=False)
        elif edit == "list":
            with open(os.path.join(bad, "state.json"), "w") as f:
                json.dump([json.load(open(os.path.join(root, "step_000003", "state.json")))], f)
        else:
            rewrite_state(bad, edit)
    else:
        expected = damage(bad, case)
    model, _, opt = build(config, seed=9)
    before = weights_of(model)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad, model, opt, one_process_group(), config)
    assert expected in str(e.value) and bad in str(e.value), str(e.value)
    assert all(torch.equal(before[n], v) for n, v in weights_of(model).items())
    assert not any(s for o in opt.optimizers for s in o.state.values())    # no moments loaded


def test_a_checkpoint_moved_to_another_machine_still_loads(saved, tmp_path):
    """Its config may name folders that do not exist here: they do not make it invalid."""
    config, root = saved
    moved = str(tmp_path / "moved" / "step_000003")
    shutil.copytree(os.path.join(root, "step_000003"), moved)
    rewrite_state(moved, lambda s: s["config"]["dataset"].update(tokenizer="/gone/tokenizer"))
    model, _, opt = build(config, seed=9)
    assert load_checkpoint(moved, model, opt, one_process_group(), config)["step"] == 3


def test_the_data_position_must_agree_with_the_step(saved, tmp_path):
    """In a directory not named after a step, the step is checked against the data position
    and the tokens seen."""
    config, root = saved
    mine = str(tmp_path / "mine")
    shutil.copytree(os.path.join(root, "step_000003"), mine)
    rewrite_state(mine, lambda s: s.update(step=2))
    with pytest.raises(CheckpointError, match="'data.next_sample' is 24, but 2 steps"):
        read_state(mine)
    rewrite_state(mine, lambda s: s["data"].update(next_sample=16))
    with pytest.raises(CheckpointError, match="'tokens_seen' is 6144, but the 2 steps"):
        read_state(mine)


def test_latest_skips_and_names_bad_checkpoints_but_a_named_one_is_refused(saved, capsys):
    config, root = saved
    os.remove(os.path.join(root, "step_000003", "state.json"))
    flip(os.path.join(root, "step_000002", "weights-pp0-tp0.safetensors"))
    path, state, _ = find_checkpoint("latest", root, "/")
    assert path == os.path.join(root, "step_000001") and state["step"] == 1
    warning = capsys.readouterr().err
    assert "skipped step_000003 (cannot read" in warning and "state.json" in warning
    assert "step_000002 (" in warning and "weights-pp0-tp0.safetensors: does not match" in warning
    with pytest.raises(CheckpointError, match="weights-pp0-tp0.safetensors: does not match"):
        find_checkpoint(os.path.join(root, "step_000002"), root, "/")
    os.remove(os.path.join(root, "step_000001", "rng-rank0.safetensors"))
    with pytest.raises(CheckpointError, match="no valid checkpoint under .*start a new run "
                                              "in another directory"):
        find_checkpoint("latest", root, "/")


def test_a_missing_shard_is_never_a_fresh_optimizer_state(saved):
    """The loader's own check, behind the manifest: moments for some parameters only."""
    config, root = saved
    step3 = os.path.join(root, "step_000003")
    model, _, opt = build(config, seed=9)
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = os.path.join(step3, "optimizer-pp0-tp0.safetensors")
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    per_param = json.loads(meta["state"])
    first = sorted(per_param)[0]
    per_param[first]["tensors"] = []
    save_file(tensors, path, dict(meta, state=json.dumps(per_param)))
    from picotron.utils import sha256
    rewrite_state(step3, lambda s: s["sha256"].update({os.path.basename(path): sha256(path)}))
    with pytest.raises(CheckpointError, match=f"not for \\['{first}'\\]"):
        load_checkpoint(step3, model, opt, one_process_group(), config)


CHANGES = {   # setting -> (how to change it, the message names)
    "training.seed": (lambda c: setattr(c.training, "seed", 7), "training.seed: checkpoint 42"),
    "dataset.name": (lambda c: setattr(c.dataset, "name", "synthetic"), "dataset.name"),
    "dataset.num_samples": (lambda c: setattr(c.dataset, "num_samples", 50),
                            "dataset.num_samples: checkpoint None, this config 50"),
    "global_batch_size": (lambda c: setattr(c.training, "micro_batch_size", 4),
                          "global_batch_size: checkpoint '8 (8 x 1 x 1)', this config "
                          "'4 (4 x 1 x 1)'"),
    "training.seq_length": (lambda c: setattr(c.training, "seq_length", 128),
                            "training.seq_length: checkpoint 256, this config 128"),
    "dataset.num_windows": (None, "dataset.num_windows: checkpoint 1000, this config 999"),
    "model.rope_theta": (lambda c: setattr(c.model, "rope_theta", 5e5),
                         "model.rope_theta: checkpoint 10000.0, this config 500000.0"),
    "model.rms_norm_eps": (lambda c: setattr(c.model, "rms_norm_eps", 1e-6),
                           "model.rms_norm_eps: checkpoint 1e-05, this config 1e-06"),
}


@pytest.mark.parametrize("setting", sorted(CHANGES))
def test_a_resume_that_changes_the_run_is_refused_unless_allowed_then_recorded(
        saved, tmp_path, setting):
    _, root = saved
    change, expected = CHANGES[setting]
    config = tiny_config()
    config.checkpoint.load_path = "latest"
    config.checkpoint.save_dir = root
    if change is not None:
        change(config)
    windows = Windows(999 if setting == "dataset.num_windows" else 1000)
    model, _, opt = build(config, seed=9)
    before = weights_of(model)
    with pytest.raises(CheckpointError) as e:
        resume(config, str(tmp_path), model, opt, one_process_group(), windows)
    assert expected in str(e.value) and f"checkpoint.allow_changes: ['{setting}']" in \
        str(e.value), str(e.value)
    assert all(torch.equal(before[n], v) for n, v in weights_of(model).items())
    config.checkpoint.allow_changes = [setting]
    step, tokens, history = resume(config, str(tmp_path), model, opt, one_process_group(),
                                   windows)
    assert step == 3 and list(history[-1]["changes"]) == [setting]
    assert history[-1]["from"].endswith("step_000003") and history[-1]["tokens_seen"] == tokens
    # The next checkpoint records it, and its tokens count from the change on.
    directory = save_at(model, opt, config, root, 4, windows=windows, tokens=tokens
                        + config.global_batch_size * config.training.seq_length,
                        history=history)
    state, _ = read_state(directory)
    assert state["accepted_changes"] == history


def test_a_checkpoint_that_did_not_save_rope_theta_still_resumes(saved, tmp_path):
    """Settings compared since a later version are optional in state.json."""
    _, root = saved
    rewrite_state(os.path.join(root, "step_000003"),
                  lambda s: s["config"]["model"].pop("rope_theta"))
    config = tiny_config()
    config.checkpoint.load_path, config.checkpoint.save_dir = "latest", root
    config.model.rope_theta = 5e5
    model, _, opt = build(config, seed=9)
    step, _, history = resume(config, str(tmp_path), model, opt, one_process_group(),
                              Windows(1000))
    assert step == 3 and history == []


def test_another_model_shape_is_refused_and_cannot_be_allowed(saved, tmp_path):
    _, root = saved
    config = tiny_config()
    config.model.hidden_size = 64
    config.checkpoint.load_path, config.checkpoint.save_dir = "latest", root
    model, _, opt = build(config, seed=9)
    with pytest.raises(CheckpointError, match="model.hidden_size: checkpoint 32, this config 64"):
        resume(config, str(tmp_path), model, opt, one_process_group(), Windows(1000))
    raw = tiny_config().to_dict()
    raw["checkpoint"]["allow_changes"] = ["model.hidden_size"]
    with pytest.raises(ConfigError, match="allow_changes names \\['model.hidden_size'\\]"):
        config_from_dict(raw)


def test_every_change_a_resume_can_report_can_be_allowed():
    """run_changes names only settings that config_checks.RESUME_CHANGES accepts."""
    a, b = tiny_config(), tiny_config()
    b.training.seed, b.training.seq_length, b.training.micro_batch_size = 1, 64, 2
    b.model.rope_theta, b.model.rms_norm_eps = 5e5, 1e-6
    for field in DATASET_FIELDS:
        value = getattr(a.dataset, field)
        setattr(b.dataset, field, 5 if field.endswith("samples") else [0, 9] if "range" in field
                else "other")
        assert getattr(b.dataset, field) != value
    names = (set(run_changes(a, b, 10, 11)) | set(run_changes(a, a, 10, 11))
             | set(run_changes(a, a, 10, 10, "old tokens", "new tokens")))
    assert names == set(RESUME_CHANGES)

