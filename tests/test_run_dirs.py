"""A run directory's earlier outputs are never lost: a new run (or a new config) over an earlier
run is refused, a resume from an older checkpoint keeps what it writes and resumes from it
again, checkpoints past step 999,999 order by step, and an fp16 resume of another dtype's
checkpoint starts loss scaling afresh."""
import json
import os
import shutil

import pytest
import torch

import create_config
from launch import read_metrics, write_config
from test_train_cli import TINY, train
from tiny import one_process_group
from picotron.checkpoint.checkpoint import (SharedCheckpointError, find_checkpoint,
                                            resolve_checkpoint, save_checkpoint)
from picotron.checkpoint.hf_io import load_hf_weights
from picotron.checkpoint.verify import latest_written, step_names
from picotron.config import Config
from picotron.model import Decoder, materialize


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """4 steps of the tiny model, a checkpoint every 2: step_000002, step_000004."""
    path = write_config(tmp_path_factory.mktemp("runs"), "earlier",
                        TINY + ["--set", "checkpoint.save_frequency=2"])
    train(path)
    return path


def test_a_new_run_or_config_over_an_earlier_run_is_refused(earlier_run, capsys):
    run_dir = os.path.dirname(earlier_run)
    metrics = open(os.path.join(run_dir, "metrics.jsonl")).read()
    done = train(earlier_run, "--set", "training.total_train_steps=1", check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("already holds a run (checkpoints step_000002 to step_000004, "
                             "metrics.jsonl)") == 1, done.stderr[-2000:]
    assert "checkpoint.load_path=latest" in done.stderr and "Traceback" not in done.stderr
    assert open(os.path.join(run_dir, "metrics.jsonl")).read() == metrics
    assert step_names(os.path.join(run_dir, "checkpoints")) == ["step_000002", "step_000004"]
    config = open(earlier_run).read()
    with pytest.raises(SystemExit) as stopped:
        create_config.main(["--out_dir", os.path.dirname(run_dir), "--exp_name", "earlier",
                            "--use_cpu", "--model_name", "debug-palm"])
    assert stopped.value.code == 2 and "already holds a run" in capsys.readouterr().err
    assert open(earlier_run).read() == config
    # a step directory named without its folder: the message gives the path that works
    done = train(earlier_run, "--set", "checkpoint.load_path=step_000002", check=False)
    assert done.returncode == 2 and "a relative path starts at the run directory, which " \
        "holds ['checkpoints/step_000002', 'checkpoints/step_000004']" in done.stderr, \
        done.stderr[-2000:]
    # the run directory itself, or a Hugging Face start from a picotron checkpoint
    with pytest.raises(SharedCheckpointError, match=f"load_path='{run_dir}' is a run directory"
                       f", not a checkpoint; name one of its checkpoints \\(e.g. {run_dir}/"
                       f"checkpoints/step_000004\\)"):
        find_checkpoint(run_dir, os.path.join(run_dir, "checkpoints"), run_dir)
    for weights in (run_dir, os.path.join(run_dir, "checkpoints", "step_000002")):
        with pytest.raises(SharedCheckpointError, match="is a picotron checkpoint, not a "
                                                        "Hugging Face model: continue"):
            load_hf_weights(None, weights)


def test_a_resume_from_an_older_checkpoint_keeps_what_it_writes(earlier_run, tmp_path):
    """Resumed from step 2 to 3 with keep_last=1: step_000003 is kept (the abandoned step 4
    goes). Without keep_last, `latest` (also what generate.py and export_hf.py read, through
    resolve_checkpoint) is step 3, not the abandoned step 4."""
    run_dir = os.path.dirname(earlier_run)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    path = str(copy / "config.json")
    train(path, "--set", "checkpoint.load_path=checkpoints/step_000002",
          "--set", "training.total_train_steps=3", "--set", "checkpoint.keep_last=1")
    save_root = str(copy / "checkpoints")
    assert step_names(save_root) == ["step_000003"] and latest_written(save_root) == \
        "step_000003"
    # a branch whose abandoned future is kept (no keep_last): latest is what was written last
    branch = tmp_path / "branch"
    shutil.copytree(run_dir, branch)
    train(str(branch / "config.json"), "--set", "checkpoint.load_path=checkpoints/step_000002",
          "--set", "training.total_train_steps=3")
    assert step_names(str(branch / "checkpoints"))[-1] == "step_000004"
    assert resolve_checkpoint("latest", str(branch / "checkpoints"), "/").endswith(
        "step_000003")
    done = train(str(branch / "config.json"), "--set", "checkpoint.load_path=latest",
                 "--set", "training.total_train_steps=4")
    assert "resumed at step 3" in done.stdout, done.stdout[-2000:]


def test_latest_says_what_it_resumes_and_keeps_every_record(earlier_run, tmp_path):
    """A metrics.jsonl whose last line was cut off (a run killed while writing it) resumes
    with a warning, its whole records kept; `latest` with no checkpoint to resume says so and
    moves an earlier run's records aside instead of truncating them."""
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(earlier_run), copy)
    metrics = copy / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + whole.splitlines()[-1][:30])
    done = train(str(copy / "config.json"), "--set", "checkpoint.load_path=latest",
                 "--set", "training.total_train_steps=5")
    assert "resumed at step 4" in done.stdout and done.stderr.count("dropped 1 line(s) that "
                                                                     "are not a whole") == 1
    assert [r["step"] for r in read_metrics(str(copy / "config.json"))] == [1, 2, 3, 4, 5]
    done = train(str(copy / "config.json"), "--set", "checkpoint.load_path=latest",
                 "--set", "checkpoint.save_dir=elsewhere", "--set", "checkpoint.save_final=false")
    assert f"no checkpoint under {copy / 'elsewhere'} yet: starting at step 0; the " \
           f"metrics.jsonl of an earlier run there is now" in done.stdout, done.stdout[-2000:]
    aside, = [f for f in os.listdir(copy) if f.startswith("metrics.jsonl.replaced-")]
    assert [json.loads(line)["step"] for line in open(copy / aside)] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in read_metrics(str(copy / "config.json"))] == [1, 2, 3, 4]


def test_a_latest_file_naming_no_checkpoint_is_named(earlier_run, tmp_path, capsys):
    """`latest` damaged, or naming a checkpoint deleted by hand: the newest valid one is
    resumed, and the warning says why it was not the one `latest` names."""
    root = tmp_path / "checkpoints"
    shutil.copytree(os.path.join(os.path.dirname(earlier_run), "checkpoints"), root)
    for text in ("step_000009", "\x00garbage"):
        (root / "latest").write_text(text)
        assert find_checkpoint("latest", str(root), "/")[0] == str(root / "step_000004")
        assert f"skipped the `latest` file's {text!r} (no such checkpoint here); resuming " \
               f"from {root / 'step_000004'}" in capsys.readouterr().err
    (root / "latest").unlink()             # deleted by hand: the newest, and said so
    assert find_checkpoint("latest", str(root), "/")[0] == str(root / "step_000004")
    assert f"skipped the `latest` file (there is none in {root}: the newest valid checkpoint " \
           f"is taken instead" in capsys.readouterr().err
    # no checkpoint left at all: a fresh start (train.py says so), as with no `latest` file
    for step in ("step_000002", "step_000004"):
        shutil.rmtree(root / step)
    assert find_checkpoint("latest", str(root), "/") == (None, None, None)


def test_steps_past_a_million_order_by_number(tmp_path):
    config = Config()
    config.model.hidden_size, config.model.intermediate_size = 32, 64
    config.model.num_hidden_layers, config.checkpoint.keep_last = 1, 2
    with torch.device("meta"):
        model = Decoder(config.model)
    model = materialize(model, 0, torch.device("cpu"), torch.float32)
    root = str(tmp_path / "checkpoints")
    config.dataset.name, batch = "synthetic", config.global_batch_size
    for step in (999_998, 999_999, 1_000_000):
        data = {"next_sample": step * batch, "global_batch_size": batch, "num_windows": None,
                "epoch": 0}
        save_checkpoint(model, None, one_process_group(), config, root, step,
                        {"tokens_seen": step * batch * config.training.seq_length,
                         "data": data})
    assert step_names(root) == ["step_999999", "step_1000000"]      # the oldest pruned
    assert resolve_checkpoint("latest", root, "/").endswith("step_1000000")


def test_an_fp16_resume_of_another_dtype_starts_at_the_initial_loss_scale(earlier_run,
                                                                          tmp_path):
    copy = tmp_path / "fp16"
    shutil.copytree(os.path.dirname(earlier_run), copy)
    path = str(copy / "config.json")
    out = train(path, "--set", "checkpoint.load_path=latest", "--set",
                "training.total_train_steps=5", "--set", "training.dtype=float16").stdout
    with open(path) as f:
        initial = json.load(f)["training"]["initial_loss_scale"]
    resumed = [r for r in read_metrics(path) if r["step"] == 5]
    assert resumed and resumed[0]["loss_scale"] == initial, resumed
    # another precision is accepted unlisted, but said and recorded in the run's history
    assert "recorded in the next checkpoints: {'training.dtype': ['float32', 'float16']}" \
        in out, out
    with open(copy / "checkpoints" / "step_000005" / "state.json") as f:
        history = json.load(f)["accepted_changes"]
    assert history[-1]["step"] == 4 and history[-1]["changes"] == {
        "training.dtype": ["float32", "float16"]}, history
