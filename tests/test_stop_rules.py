"""Runs that must stop, and how: a diverged loss stops with the step and the last good
checkpoint; weights that turned non-finite never become `latest`; Ctrl-C on one process stops
after the step, saves and exits 130; the watchdog's heartbeat is consistent with the
collective timeout by construction."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import ROOT, write_config
from picotron.config import ConfigError, config_from_dict
from picotron.config.checks import heartbeat_seconds
from picotron.run.divergence import DivergenceCheck

TINY = ["--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2", "--num_hidden_layers",
        "2", "--set", "training.warmup_steps=1"]
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def run(script, *args, timeout=300):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=ENV)


def latest(run_dir):
    with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
        return f.read().strip()


def test_heartbeat_is_derived_from_the_timeout_or_refused_above_it():
    derived = config_from_dict({"distributed": {"timeout_s": 30}})
    assert heartbeat_seconds(derived.distributed) == 15        # min(60, 30 / 2)
    assert heartbeat_seconds(config_from_dict({}).distributed) == 60
    with pytest.raises(ConfigError, match=r"distributed.heartbeat_s=60 would name a frozen rank "
                                          r"only after up to 75 s.*below timeout_s / 1.25 = 24"):
        config_from_dict({"distributed": {"timeout_s": 30, "heartbeat_s": 60}})
    with pytest.raises(ConfigError, match="training.divergence_factor=1 would stop any run"):
        config_from_dict({"training": {"divergence_factor": 1}})


class Training:
    divergence_factor, divergence_steps, learning_rate = 3.0, 20, 1e-3


def test_the_divergence_rule_on_losses_it_must_and_must_not_stop(tmp_path):
    spike = [5.0 - 0.1 * i for i in range(30)] + [8.0] * 5 + [2.1] * 40   # 4x for 5 steps
    check = DivergenceCheck(Training, str(tmp_path))
    assert [check.update(i + 1, x) for i, x in enumerate(spike)] == [None] * len(spike)
    check = DivergenceCheck(Training, str(tmp_path))                   # the mean of 20
    said = [check.update(i + 1, x) for i, x in enumerate([3.0] + [10.0] * 40)]
    first = next(i for i, m in enumerate(said) if m) + 1
    assert first == 20 and sum(map(bool, said)) == 1, said            # once, at the 1st window
    assert "mean over steps 1-20 is 9.65, above 3x its best (3.0000 at step 1)" in said[19]
    assert "no checkpoint was saved before it" in said[19]
    nan = DivergenceCheck(Training, str(tmp_path))       # left to training.max_skipped_steps
    assert not any(nan.update(i + 1, float("nan")) for i in range(40))


def test_a_diverging_run_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    path = write_config(tmp_path, "diverge", TINY + [
        "--dataset_name", "embedded", "--seq_len", "64", "--mbs", "4",
        "--total_train_steps", "10", "--set", "checkpoint.save_frequency=5"])
    run_dir = os.path.dirname(path)
    train = os.path.join(ROOT, "train.py")
    assert run(train, "--config", path).returncode == 0              # a healthy first part
    done = run(train, "--config", path, "--set", "checkpoint.load_path=latest",
               "--set", "training.total_train_steps=200", "--set", "training.learning_rate=1")
    said = [x for x in done.stderr.splitlines() if x.startswith("error")]
    assert done.returncode == 2 and len(said) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "the loss diverged: its mean over steps 11-30 is" in said[0], said
    good = os.path.join(run_dir, "checkpoints", "step_000010")
    assert f"resume from {good}" in said[0] and "training.learning_rate (now 1)" in said[0]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    # seen at step 30, logged once step 31 was queued: one process stops after step 31
    # (several ranks stop after step 32, the step they agree on in the launcher's store)
    assert steps[-1] == 31, steps[-3:]
    assert latest(run_dir) == "step_000030"     # saved while diverging, named as no place


@pytest.mark.parametrize("mode", ["save", "sigterm"])
def test_non_finite_weights_never_become_latest(tmp_path, mode):
    path = write_config(tmp_path, mode, TINY + [
        "--total_train_steps", "12", "--set", "checkpoint.save_frequency=4"])
    run_dir = os.path.dirname(path)
    worker = os.path.join(ROOT, "tests", "workers", "nan_weights_run.py")
    # poisoned at a save's own step, or at the step of the signal (a step after the poisoned
    # one is skipped, its NaN loss giving a NaN gradient, and is never saved at all)
    stop_step = 8 if mode == "save" else 6
    done = run(worker, path, str(stop_step), mode)
    said = [x for x in done.stderr.splitlines() if x.startswith("error")]
    assert done.returncode == 2 and len(said) == 1, done.stderr[-3000:]
    assert f"not saving {run_dir}/checkpoints/step_{stop_step:06d}" in said[0], said
    assert "holds non-finite values" in said[0] and "`latest` stays step_000004" in said[0]
    assert latest(run_dir) == "step_000004"
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", f"step_{stop_step:06d}"))
    assert "stopped by" not in done.stdout


def test_ctrl_c_on_one_process_stops_after_the_step_saves_and_exits_130(tmp_path):
    path = write_config(tmp_path, "ctrl-c", TINY + ["--total_train_steps", "100000"])
    run_dir = os.path.dirname(path)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--config", path],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    end = time.time() + 120
    while time.time() < end and not (os.path.exists(metrics) and os.path.getsize(metrics)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    step = int(last.split(" after step ")[1].split(":")[0])
    assert last == (f"stopped by Ctrl-C (SIGINT) after step {step}: checkpoint "
                    f"{run_dir}/checkpoints/step_{step:06d} saved; resume with --set "
                    f"checkpoint.load_path=latest"), last
    assert latest(run_dir) == f"step_{step:06d}"


def test_a_float16_run_whose_loss_turns_nan_ends_non_zero_naming_a_good_latest(tmp_path):
    """float16 at learning rate 1 (warmed up over 6 steps), a checkpoint at every step, fewer
    steps than training.max_skipped_steps: one step's update makes weights whose float16
    forward overflows, and every loss after it is NaN, every step skipped. No checkpoint is
    written of a skipped step; the run ends with status 2 naming the steps, and `latest`, which
    named the checkpoint of the update that broke the weights, names the one before it."""
    path = write_config(tmp_path, "fp16", TINY + [
        "--total_train_steps", "9", "--set", "training.dtype=float16",
        "--set", "training.learning_rate=1", "--set", "training.warmup_steps=6",
        "--set", "checkpoint.save_frequency=1"])
    run_dir = os.path.dirname(path)
    root = os.path.join(run_dir, "checkpoints")
    done = run(os.path.join(ROOT, "train.py"), "--config", path)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    trained = [r["step"] for r in records if not r["skipped"]]
    broke = trained[-1]                  # the last update: every loss after it is NaN
    assert [r["loss"] for r in records[broke:]] == [None] * (9 - broke), records   # NaN: null
    assert len(trained) >= 2 and broke < 9 - 2, records
    assert sorted(os.listdir(root)) == ["latest"] + [f"step_{s:06d}" for s in trained]
    said = [x for x in done.stderr.splitlines() if x.startswith("error")]
    assert done.returncode == 2 and len(said) == 1, (done.stdout[-2000:], done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "done:" not in done.stdout
    good = trained[-2]
    assert said[0] == (
        f"error: the run ended while skipping: steps {broke + 1}-9 ({9 - broke} in a row) were "
        f"skipped for a non-finite gradient and its last loss is not finite; its weights did "
        f"not train after step {broke}. The last checkpoint written before step {broke}, whose "
        f"update made every loss after it non-finite: {root}/step_{good:06d} (`latest` now "
        f"names it, not step_{broke:06d}). Lower training.learning_rate (now 1), or with "
        f"float16 use bfloat16, then resume with --set checkpoint.load_path=latest"), said
    assert latest(run_dir) == f"step_{good:06d}"
    left_out = [x for x in done.stdout.splitlines() if x.startswith("warning: not saving")]
    assert len(left_out) == 9 - len(trained), left_out


@pytest.mark.parametrize("first_bad", [5, 8])
def test_a_run_that_ends_skipping_ends_non_zero_and_a_last_lone_skip_does_not(tmp_path,
                                                                              first_bad):
    """Gradients reported non-finite from step `first_bad` of 8 (tests/workers/
    diverging_run.py), the losses finite. Steps 5-8 skipped: status 2, the saves at 6 and 8
    left out. Only step 8 skipped (a float16 loss scale's lone overflow looks so): the run is
    done, without a checkpoint of step 8, and says so."""
    path = write_config(tmp_path, "skips", TINY + [
        "--total_train_steps", "8", "--set", "checkpoint.save_frequency=2"])
    run_dir = os.path.dirname(path)
    done = run(os.path.join(ROOT, "tests", "workers", "diverging_run.py"), path,
               str(first_bad))
    root = os.path.join(run_dir, "checkpoints")
    if first_bad == 5:
        said = [x for x in done.stderr.splitlines() if x.startswith("error")]
        assert done.returncode == 2 and len(said) == 1, done.stderr[-3000:]
        assert said[0].startswith("error: the run ended while skipping: steps 5-8 (4 in a "
                                  "row) were skipped for a non-finite gradient and its last "
                                  "loss is finite; its weights did not train after step 4. "
                                  f"The last checkpoint written before them: {root}/"
                                  f"step_000004 (`latest` names it)"), said
        assert latest(run_dir) == "step_000004"
        assert sorted(os.listdir(root)) == ["latest", "step_000002", "step_000004"]
    else:
        assert done.returncode == 0, done.stderr[-3000:]
        last = done.stdout.strip().splitlines()[-1]
        assert last.startswith("done: 8 steps") and "1 step skipped" in last, last
        assert f"checkpoint {root}/step_000006 (not step 8: step 8 was skipped)" in last, last
        assert latest(run_dir) == "step_000006"
        assert "warning: not saving " + f"{root}/step_000008: step 8 was skipped" in done.stdout
