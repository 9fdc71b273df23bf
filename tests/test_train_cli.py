"""train.py as a user meets it: `--set` overrides, progress and the closing summary, a
finished run resumed, a run that stops when it no longer trains, and an error said once."""
import json
import os
import re
import subprocess
import sys
from unittest import mock

import pytest
import torch

from launch import ROOT, free_port, write_config
from picotron.config import Config, ConfigError, load_config
from picotron.config.overrides import SECTIONS, apply_overrides
from picotron.utils import set_cpu_threads

TINY = ["--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2", "--num_hidden_layers",
        "2", "--total_train_steps", "4", "--set", "training.warmup_steps=1"]


def train(config_path, *extra, nproc=1, check=True):
    """Run train.py as a user does (torchrun for nproc > 1); returns the finished process."""
    script = [os.path.join(ROOT, "train.py"), "--config", config_path, *extra]
    cmd = [sys.executable, *script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(free_port()), *script]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_override_sections_are_the_configs():
    assert SECTIONS == tuple(Config().to_dict())


def test_set_overrides_the_file_and_is_validated(tmp_path):
    path = write_config(tmp_path, "over", TINY)
    config = load_config(path, overrides=["training.learning_rate=0.01",
                                          "dataset.name=synthetic", "logging.run_name=x y"])
    assert config.training.learning_rate == 0.01 and config.logging.run_name == "x y"
    with open(path) as f:                                   # the file itself is unchanged
        assert json.load(f)["training"]["learning_rate"] != 0.01
    for bad, words in ((["training.learnin_rate=1"], ["learnin_rate", "learning_rate"]),
                       (["trainin.seed=1"], ["unknown section 'trainin'"]),
                       (["seed=1"], ["section.key=value"]),
                       (["training.micro_batch_size=\"2\""], ["micro_batch_size", "int"])):
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides=bad)
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ConfigError, match="'training' in the config is not a section"):
        apply_overrides({"training": 3}, ["training.seed=1"])


def test_progress_summary_resume_and_the_launch_record(tmp_path):
    path = write_config(tmp_path, "run", TINY)
    out = train(path).stdout
    steps = [line for line in out.splitlines() if line.startswith("step")]
    assert [s.split("|")[0].split()[1] for s in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert "tokens" in steps[-1] and re.search(r"\| \d+s, \d+s left", steps[-1]), steps[-1]
    last = out.splitlines()[-1]
    assert last.startswith("done: 4 steps (0 -> 4)") and "final loss" in last, last
    assert "step_000004" in last and "metrics.jsonl" in last, last   # saved by default
    # resumed with nothing left: said, not silently done
    again = train(path, "--set", "checkpoint.load_path=latest").stdout
    assert "nothing to train" in again and "total_train_steps=8" in again, again
    # resumed with more steps: continues, and the launch record keeps each command
    more = train(path, "--set", "checkpoint.load_path=latest",
                 "--set", "training.total_train_steps=6").stdout
    assert "resumed at step 4" in more and "done: 2 steps (4 -> 6)" in more, more
    with open(os.path.join(tmp_path, "run", "launches.jsonl")) as f:
        launches = [json.loads(line) for line in f]
    assert [x["start_step"] for x in launches] == [0, 4, 4]
    assert launches[2]["overrides"] == ["checkpoint.load_path=latest",
                                        "training.total_train_steps=6"]


def test_a_run_whose_steps_are_all_skipped_stops(tmp_path):
    path = write_config(tmp_path, "diverge", TINY + [
        "--set", "training.total_train_steps=30", "--set", "training.max_skipped_steps=3"])
    worker = os.path.join(ROOT, "tests", "workers", "diverging_run.py")
    done = subprocess.run([sys.executable, worker, path, "3"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the last 3 steps (to step 5)" in done.stderr, done.stderr[-2000:]
    assert "learning_rate" in done.stderr and "Traceback" not in done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("step")]
    # step 6 was queued when step 5 was read: it is logged on the way out, not trained on
    assert len(steps) == 6 and all("step skipped" in s for s in steps[2:]), done.stdout
    assert not os.path.exists(os.path.join(tmp_path, "diverge", "checkpoints"))


@pytest.mark.parametrize("bad", ["config", "data", "checkpoint"])
def test_an_error_is_said_once_and_named_at_the_end(tmp_path, bad):
    """A config every rank reads, data rank 0 prepares for all, or a resume the ranks refuse
    together: one message, not one per rank."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}. " * 20}) + "\n"
                            for i in range(40)))
    path = write_config(tmp_path, "bad", TINY + ["--dp", "2", "--dataset_name", str(docs)])
    setting, said = {"config": ("training.learnin_rate=1", "unknown key 'training.learnin_rate'"),
                     "data": ("dataset.text_column=body", "has no column 'body'"),
                     "checkpoint": ("training.seed=7", "would change the run: training.seed")
                     }[bad]
    extra = ()
    if bad == "checkpoint":             # a checkpoint that the run with another seed resumes
        train(path, "--set", "distributed.dp_size=1")
        extra = ("--set", "checkpoint.load_path=latest")
    done = train(path, "--set", setting, *extra, nproc=2, check=False)
    assert done.returncode != 0
    # once by rank 0, once in torchrun's closing report (its root cause), nowhere else
    assert done.stderr.count(said) == 2, done.stderr
    tail = done.stderr[done.stderr.rindex("Root Cause"):]
    assert said in tail and "rank      : 0" in tail, tail


def test_likely_mistakes_are_warned_of_with_their_fix(tmp_path, capsys):
    import create_config
    from picotron.config.checks import config_warnings
    from picotron.run.report import data_warning
    config = Config()
    config.training.warmup_steps, config.training.total_train_steps = 10, 10
    assert "--set training.warmup_steps=1" in config_warnings(config)[0]
    config.training.total_train_steps = 11
    assert config_warnings(config) == []
    create_config.main(["--out_dir", str(tmp_path), "--exp_name", "w", *TINY[:-2]])
    assert "training.warmup_steps=10 is not below" in capsys.readouterr().err
    few = mock.Mock(num_windows=config.global_batch_size - 1)
    assert "some windows twice" in data_warning(config, few)
    assert data_warning(config, mock.Mock(num_windows=config.global_batch_size)) is None
    assert data_warning(config, object()) is None           # synthetic tokens: no windows


def test_threads_are_the_core_share_of_each_local_process_or_as_set():
    """cores // processes, at least one each; distributed.cpu_threads overrides the policy."""
    before = torch.get_num_threads()
    try:
        with mock.patch("picotron.utils.cpu_share", return_value=8):
            assert set_cpu_threads(4) == 2 and torch.get_num_threads() == 2
            assert set_cpu_threads(16) == 1
            assert set_cpu_threads(1) == 8
            assert set_cpu_threads(1, threads=3) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
