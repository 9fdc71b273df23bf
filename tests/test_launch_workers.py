"""`python train.py --nproc_per_node N`: train.py starts its workers through torch's elastic
launcher and ends as they do: one line and status 2 for a config refused for its world size,
status 130 and a checkpoint after a Ctrl-C to the terminal's process group, status 143 after a
SIGTERM to the launcher alone (as a scheduler sends it); never a traceback, a ChildFailedError
box or torch's launcher log lines. Each launch costs ~15 s here, so each checks all it can.
The choice of the status and the flags torchrun is given are checked without launching."""
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from launch import ROOT, write_config
from picotron.run import launch_workers as lw

ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
TINY = ["--dp", "2", "--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2",
        "--num_hidden_layers", "2", "--set", "training.warmup_steps=1"]
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "SignalException", "torch/distributed",
                  "exitcode", "closing signal", "KeyboardInterrupt")


def start(config_path, nproc=2, *extra):
    """`python train.py --nproc_per_node nproc --config config_path` in a session of its own
    (a terminal's foreground process group: the workers start in sessions of theirs)."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--nproc_per_node", str(nproc),
           "--config", config_path, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def assert_quiet_launcher(output: str) -> None:
    for noise in LAUNCHER_NOISE:
        assert noise not in output, (noise, output[-3000:])


def test_a_wrong_world_size_is_one_line_and_status_2(tmp_path):
    path = write_config(tmp_path, "ws", TINY + ["--total_train_steps", "4"])
    proc = start(path, 3)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    assert_quiet_launcher(out)
    assert out.count("but 3 processes were launched") == 1, out
    assert out.strip().splitlines()[-2:] == [
        "error: invalid config:",
        "  - dp_size*tp_size*pp_size*cp_size = 2*1*1*1 = 2, but 3 processes were launched; "
        "launch with --nproc_per_node 2 (train.py's or torchrun's) or change the sizes"], out


def started_steps(proc, lines: list, steps: int) -> None:
    """Read proc's output into `lines` until `steps` step lines were printed."""
    while sum(line.startswith("step ") for line in lines) < steps:
        line = proc.stdout.readline()
        assert line, "".join(lines)[-3000:]
        lines.append(line)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_saves_says_stopped_once_and_exits_with_the_workers_status(tmp_path, how):
    path = write_config(tmp_path, how, TINY + ["--total_train_steps", "100000"])
    run_dir = os.path.dirname(path)
    proc, lines = start(path), []
    started_steps(proc, lines, 2)
    if how == "ctrl-c":     # a terminal signals its foreground process group
        os.killpg(proc.pid, signal.SIGINT)
    else:                   # a scheduler signals the process it started
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    out = "".join(lines) + out
    name, status = {"ctrl-c": ("Ctrl-C (SIGINT)", 130), "sigterm": ("SIGTERM", 143)}[how]
    assert proc.returncode == status, out[-3000:]
    assert_quiet_launcher(out)
    assert out.count("stopped by") == 1 and "done:" not in out, out[-3000:]
    summary, last = out.strip().splitlines()[-2:]
    step = int(last.split(" after step ")[1].split(":")[0])
    saved = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    assert summary.startswith(f"stopped: {step} steps (0 -> {step})"), summary
    assert last == (f"stopped by {name} after step {step}: checkpoint {saved} saved; resume "
                    f"with --set checkpoint.load_path=latest"), last
    assert os.path.isdir(saved)


def failure(exitcode: int, timestamp: int, pid: int = 100):
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, pid=pid)


def test_the_status_is_the_worker_that_said_why_not_the_ranks_the_agent_ended(capsys):
    # rank 0 refused the config (2) after rank 2 had been terminated by the agent (-15)
    assert lw._workers_status({2: failure(-15, 10), 0: failure(2, 11), 1: failure(3, 12)}) == 2
    assert capsys.readouterr().err == ""           # the worker printed its own line
    assert lw._workers_status({1: failure(-9, 11, 7), 3: failure(-15, 12)}) == 137
    assert capsys.readouterr().err == (
        "error: rank 1 (pid 7) was killed by SIGKILL (by no part of this run: another "
        "program, the out-of-memory killer?); the other workers were stopped; resume with "
        "--set checkpoint.load_path=latest\n")


def launch_args(**given):
    return SimpleNamespace(**{**{flag[2:]: None for flag, _, _ in lw.LAUNCH_FLAGS}, **given})


def test_torchrun_is_given_the_flags_as_typed_and_one_machine_takes_a_free_port(monkeypatch):
    script = ["train.py", "--config", "c.json"]
    monkeypatch.setattr(lw, "free_port", lambda: 41234)
    assert lw.torchrun_argv(launch_args(nproc_per_node="4"), *script[:1], script[1:]) == [
        "--nproc_per_node=4", "--master_port=41234", *script]
    assert lw.torchrun_argv(launch_args(nproc_per_node="4"), script[0], script[1:], fork=True) \
        == ["--nproc_per_node=4", "--run-path", "--start-method=fork", "--master_port=41234",
            *script]
    assert lw.torchrun_argv(launch_args(nproc_per_node="4", master_port="29555"), script[0],
                            script[1:]) == ["--nproc_per_node=4", "--master_port=29555", *script]
    two = launch_args(nproc_per_node="8", nnodes="2", rdzv_backend="c10d",
                      rdzv_endpoint="node0:29400", rdzv_id="job")
    assert lw.torchrun_argv(two, script[0], script[1:]) == [
        "--nproc_per_node=8", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29400",
        "--rdzv_id=job", *script]


def test_launch_flags_given_to_a_worker_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    args = launch_args(nproc_per_node="2", config="c.json", set=[])
    assert lw.launch_workers(args, "train.py") == 2
    assert "this process is already a worker of a launcher" in capsys.readouterr().err
