"""What a run says before its first step about where it starts from: where its weights came
from (drawn from the seed, a checkpoint, a Hugging Face folder), and on a resume whose
learning-rate schedule differs from the checkpoint's, the lr each schedule gives the next step.

One tiny run (4 steps on CPU, synthetic tokens, checkpoints at steps 2 and 4) is trained in
this process and shared; each test resumes or fine-tunes a copy of it. The expected lrs come
from the schedule function itself, never from numbers copied from a run."""
import contextlib
import copy
import io
import os
import re
import shutil
from types import SimpleNamespace

import pytest
from safetensors import safe_open

import train
from checkpoint_helpers import rewrite_state
from launch import write_config
from picotron.checkpoint.changes import schedule_change
from picotron.checkpoint.checkpoint import load_full_weights
from picotron.checkpoint.hf_io import export_hf
from picotron.config import Config, load_config
from picotron.utils import SCHEDULE_SETTINGS, lr_at

TINY = ["--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2", "--num_hidden_layers",
        "2", "--total_train_steps", "4", "--set", "training.warmup_steps=1",
        "--set", "checkpoint.save_frequency=2"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(config path, what the run printed) of the shared run."""
    path = write_config(tmp_path_factory.mktemp("runs"), "run", TINY)
    return path, run(path)


def run(path, *overrides) -> str:
    """train.py in this process with `--set` overrides; returns what it printed."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        train.main(["--config", path] + [a for o in overrides for a in ("--set", o)])
    return out.getvalue()


def copy_of(first_run, tmp_path) -> str:
    """The shared run's folder copied (a resume writes into it); its config's path."""
    shutil.copytree(os.path.dirname(first_run[0]), tmp_path / "run")
    return str(tmp_path / "run" / "config.json")


def test_a_new_run_says_its_weights_are_drawn_from_the_seed(first_run):
    path, out = first_run
    seed = load_config(path).training.seed
    assert f"\nweights: random init (seed {seed})\n" in out, out[:3000]
    assert "resumed at step" not in out and "schedule changes" not in out


def test_a_resume_that_changes_the_schedule_says_both_lrs(first_run, tmp_path):
    """Steps 4 -> 6: the checkpoint's cosine ended at step 4 (step 5 would get the floor),
    this config's reaches its floor at step 6, so the lr rises again at step 5."""
    path = copy_of(first_run, tmp_path)
    out = run(path, "checkpoint.load_path=latest", "training.total_train_steps=6")
    old = load_config(path).training
    new = load_config(path, overrides=["training.total_train_steps=6"]).training
    before, after = f"{lr_at(5, old):.2e}", f"{lr_at(5, new):.2e}"
    assert before != after                       # the words would say nothing otherwise
    said = (f"resumed at step 4 from latest; the schedule changes: lr at step 5 would be "
            f"{before} under the checkpoint's (4 steps), is {after} under this config "
            f"(6 steps)")
    assert out.count(said) == 1, out[:3000]
    # the step line uses the new schedule, as said
    assert re.search(rf"step +5/6 \| loss [0-9.]+ \| lr {after} \|", out), out[-2000:]
    checkpoint = os.path.join(os.path.dirname(path), "checkpoints", "step_000004")
    tensors = len(load_full_weights(checkpoint))
    assert f"\nweights: loaded from checkpoint {checkpoint} (step 4, {tensors} tensors)\n" \
        in out, out[:3000]


def test_a_resume_with_the_same_schedule_says_no_such_words(first_run, tmp_path):
    path = copy_of(first_run, tmp_path)
    out = run(path, "checkpoint.load_path=checkpoints/step_000002")
    assert "resumed at step 2 from checkpoints/step_000002\n" in out, out[:3000]
    assert "schedule" not in out, out[:3000]
    checkpoint = os.path.join(os.path.dirname(path), "checkpoints/step_000002")
    tensors = len(load_full_weights(checkpoint))
    assert f"weights: loaded from checkpoint {checkpoint} (step 2, {tensors} tensors)" in out


def test_a_checkpoint_that_did_not_save_its_schedule_still_resumes(first_run, tmp_path):
    """The schedule's settings are read when present: without one, nothing is said of it."""
    path = copy_of(first_run, tmp_path)
    rewrite_state(os.path.join(os.path.dirname(path), "checkpoints", "step_000004"),
                  lambda s: s["config"]["training"].pop("learning_rate"))
    out = run(path, "checkpoint.load_path=latest", "training.total_train_steps=6")
    assert "resumed at step 4 from latest\n" in out and "schedule" not in out, out[:3000]


def test_a_fine_tune_says_it_loaded_the_hugging_face_folder(first_run, tmp_path):
    path, _ = first_run
    folder = export_hf(os.path.join(os.path.dirname(path), "checkpoints", "step_000004"),
                       str(tmp_path / "hf"))
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    tuned = write_config(tmp_path, "ft", ["--model_name", folder, "--dataset_name",
                                          "synthetic", "--seq_len", "32", "--mbs", "2",
                                          "--total_train_steps", "1"])
    out = run(tuned)
    assert load_config(tuned).checkpoint.init_from == os.path.abspath(folder)
    assert (f"\nweights: loaded from Hugging Face folder {os.path.abspath(folder)} "
            f"({tensors} tensors)\n") in out, out[:3000]


@pytest.mark.parametrize("setting", sorted(SCHEDULE_SETTINGS))
def test_each_schedule_setting_a_resume_changes_is_said(setting):
    """Every setting lr_at reads is named with both values, and both lrs come from lr_at."""
    saved, config = Config(), Config()
    saved.training.total_train_steps, config.training.total_train_steps = 200, 200
    value = getattr(config.training, setting)
    setattr(config.training, setting, value * 2 if setting != "min_lr_ratio" else 0.5)
    said = schedule_change(saved, config, 100)
    old, new = (SCHEDULE_SETTINGS[setting].format(getattr(c.training, setting))
                for c in (saved, config))
    assert said == (f"the schedule changes: lr at step 101 would be "
                    f"{lr_at(101, saved.training):.2e} under the checkpoint's ({old}), is "
                    f"{lr_at(101, config.training):.2e} under this config ({new})")
    assert schedule_change(saved, copy.deepcopy(saved), 100) is None      # the same schedule
    assert schedule_change(saved, config, config.training.total_train_steps) is None  # no step


def test_a_schedule_change_with_the_same_next_lr_says_it_once():
    """In the warm-up a longer run's lr is the same at the next step: the line says the
    schedule changes and gives that lr once, instead of "would be X ..., is X"."""
    saved, config = Config(), Config()
    saved.training.total_train_steps, config.training.total_train_steps = 200, 220
    assert lr_at(6, saved.training) == lr_at(6, config.training)          # warm-up: 10 steps
    said = schedule_change(saved, config, 5)
    assert said == (f"the schedule changes, from the checkpoint's 200 steps to this config's "
                    f"220 steps; lr at step 6 is {lr_at(6, config.training):.2e} under both")


def test_lr_at_reads_only_the_schedule_settings():
    """SCHEDULE_SETTINGS is all lr_at reads: a training section holding only them suffices,
    so a resume that changes anything lr_at depends on is said."""
    full = Config().training
    only = SimpleNamespace(**{k: getattr(full, k) for k in SCHEDULE_SETTINGS})
    for step in (1, full.warmup_steps, full.warmup_steps + 1, full.total_train_steps,
                 full.total_train_steps + 5):
        assert lr_at(step, only) == lr_at(step, full)


def test_a_four_rank_start_says_each_phase_once_in_order(tmp_path):
    """Under torchrun, before the first step: rank 0's line as soon as the config is read,
    then the logging rank's first lines and one line per phase with its seconds, each once
    (not once per rank), in the order the phases run."""
    from test_train_cli import train as launch_train
    path = write_config(tmp_path, "four", TINY + ["--dp", "2", "--tp", "2",
                                                  "--total_train_steps", "2"])
    lines = launch_train(path, nproc=4).stdout.splitlines()
    phases = ["config read", "auto on cpu", "rank ", "process groups and checks in ",
              "model built in ", "data ready in ", "weights: ", "first step queued in ",
              "step     1/2"]
    found = [[i for i, line in enumerate(lines) if line.startswith(p)] for p in phases]
    assert all(len(f) == 1 for f in found), (found, lines)
    assert [f[0] for f in found] == sorted(f[0] for f in found), lines
    assert "4 ranks = dp 2 x tp 2 x pp 1 x cp 1" in lines[found[0][0]], lines
    assert re.fullmatch(r"model built in \d+\.\ds", lines[found[4][0]]), lines
