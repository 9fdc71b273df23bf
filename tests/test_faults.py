"""Faults on 4 gloo ranks, as a cluster produces them, each timed and each resumed exactly.

- kill -9 of one rank during a step, and during a checkpoint write: the run ends (torchrun
  notices the dead worker), and `--set checkpoint.load_path=latest` continues to the same
  losses and weights as a run never interrupted;
- SIGTERM to torchrun (a scheduler's notice) and SIGINT (Ctrl-C): every rank stops after the
  same step, a checkpoint is saved, the exit status says so, and the resume is exact;
- a frozen rank (SIGSTOP): every other rank stops within distributed.heartbeat_s plus one
  interval, naming the frozen rank (picotron/run/watchdog.py);
- kill -9 of torchrun itself: its workers exit instead of training on;
- a save that cannot start (its directory cannot be made): every rank stops with one message
  naming the checkpoint and the fix, and the checkpoints before it resume exactly.
Two layouts share the cases: dp2 x tp2, and dp2 x pp2. The detection times are printed
(`pytest -s`), and the README's reliability section quotes them."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import ROOT, free_port, launch_many, launch_script, process_alive, write_config

HEARTBEAT_S = 6.0
LAYOUTS = {"dp2-tp2": ["--dp", "2", "--tp", "2"], "dp2-pp2": ["--dp", "2", "--pp", "2"]}
STEPS = 14


def config_for(tmp_path, name, layout):
    return write_config(tmp_path, name, LAYOUTS[layout] + [
        "--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2", "--grad_acc_steps", "2",
        "--num_hidden_layers", "2", "--total_train_steps", str(STEPS),
        "--set", "training.warmup_steps=2", "--set", "checkpoint.save_frequency=2",
        "--set", f"distributed.heartbeat_s={HEARTBEAT_S}", "--set", "distributed.timeout_s=60"])


def start(config_path, *extra):
    """torchrun on 4 ranks, in its own session (so a test can signal all of it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), os.path.join(ROOT, "train.py"), "--config",
           config_path, *extra]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    logs = os.path.dirname(config_path)          # files, not pipes: a full pipe blocks a rank
    out, err = (open(os.path.join(logs, f"{n}.{time.time()}.txt"), "w+") for n in ("out", "err"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True,
                            start_new_session=True)
    proc.out_file, proc.err_file = out, err
    return proc


def read(file) -> str:
    file.flush()
    with open(file.name) as f:
        return f.read()


def workers(launcher_pid) -> dict:
    """{rank: pid} of torchrun's worker processes."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if ppid == launcher_pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def wait_for(predicate, timeout=120, every=0.01):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting")


def logged_steps(config_path) -> int:
    path = os.path.join(os.path.dirname(config_path), "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return max([json.loads(x).get("step", 0) for x in f if x.strip()] or [0])


def losses(config_path) -> list:
    with open(os.path.join(os.path.dirname(config_path), "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def finish(proc, timeout=120):
    proc.wait(timeout=timeout)
    return proc.returncode, read(proc.out_file), read(proc.err_file)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each layout's run without a fault: the losses every resumed run must reproduce. These
    runs and the resumes test no launcher behaviour, so they start through the forking test
    launcher (tests/launch.py), the faults through torchrun."""
    paths = {layout: config_for(tmp_path_factory.mktemp(layout), "clean", layout)
             for layout in LAYOUTS}
    launch_many(list(paths.values()), 4)
    return {layout: losses(path) for layout, path in paths.items()}


def resume_and_compare(path, expected):
    out = launch_script(os.path.join(ROOT, "train.py"), 4,
                        ["--config", path, "--set", "checkpoint.load_path=latest"]).stdout
    assert "resumed at step" in out, out[-2000:]
    assert losses(path) == expected         # bitwise: same data, same order, same weights


CASES = [("dp2-tp2", "kill-mid-step"), ("dp2-tp2", "sigterm"), ("dp2-pp2", "kill-mid-save"),
         ("dp2-pp2", "sigint"), ("dp2-tp2", "save-fails")]


@pytest.mark.parametrize("layout,fault", CASES)
def test_fault_then_exact_resume(tmp_path, uninterrupted, layout, fault):
    path = config_for(tmp_path, "run", layout)
    root = os.path.join(tmp_path, "run", "checkpoints")
    blocker = os.path.join(root, "step_000006.tmp")
    if fault == "save-fails":        # step 6's save cannot start: a file where its .tmp goes
        os.makedirs(root)            # (as root, the CI's user, a read-only mode blocks nothing)
        open(blocker, "w").close()
    proc = start(path)
    if fault == "kill-mid-save":     # the moment a checkpoint directory is being written
        wait_for(lambda: logged_steps(path) >= 4 and any(
            d.endswith(".tmp") for d in os.listdir(root)), every=0.001)
    elif fault != "save-fails":
        wait_for(lambda: logged_steps(path) >= 5)
    hit = time.time()
    if fault.startswith("kill"):
        os.kill(workers(proc.pid)[2], signal.SIGKILL)
    elif fault in ("sigterm", "sigint"):
        os.kill(proc.pid, signal.SIGTERM if fault == "sigterm" else signal.SIGINT)
    rc, out, err = finish(proc)
    took = time.time() - hit
    print(f"\n{layout} {fault}: torchrun exited {rc} after {took:.1f} s")
    assert rc != 0 and took < 60, (rc, took, err[-3000:])
    if fault == "sigterm":           # every rank stopped after one step, and saved it
        assert "stopped by SIGTERM after step" in out, (out[-2000:], err[-3000:])
        stopped = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
        assert os.path.isdir(os.path.join(root, f"step_{stopped:06d}"))
    if fault == "save-fails":        # said once, by rank 0, with no rank's traceback
        said = [x for x in err.splitlines() if x.startswith("error")]
        assert len(said) == 1 and "could not start checkpoint" in said[0], err[-3000:]
        assert "step_000006" in said[0] and "load_path=latest" in said[0], said
        assert not any(x.startswith("[rank") for x in err.splitlines()), err[-3000:]
        assert logged_steps(path) == 6 and os.path.isdir(os.path.join(root, "step_000004"))
        os.remove(blocker)
    assert logged_steps(path) < STEPS, "the fault came too late to test anything"
    resume_and_compare(path, uninterrupted[layout])


def test_a_frozen_rank_is_named_within_the_heartbeat(tmp_path):
    path = config_for(tmp_path, "frozen", "dp2-pp2")
    proc = start(path)
    wait_for(lambda: logged_steps(path) >= 3)
    frozen = workers(proc.pid)[1]
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        line = wait_for(lambda: next((x for x in read(proc.err_file).splitlines()
                                      if "no heartbeat" in x), None), timeout=HEARTBEAT_S * 3 + 30)
        took = time.time() - stopped_at
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        os.kill(frozen, signal.SIGCONT)
        proc.wait()
    print(f"\nfrozen rank 1 named after {took:.1f} s: {line}")
    assert "rank 1 has sent no heartbeat" in line and "its last step was" in line, line
    assert took <= HEARTBEAT_S * 1.25 + 5, took        # the bound: heartbeat_s + 1 interval


def test_workers_exit_when_the_launcher_dies(tmp_path):
    path = config_for(tmp_path, "orphans", "dp2-tp2")
    proc = start(path, "--set", f"training.total_train_steps={STEPS * 50}")
    wait_for(lambda: logged_steps(path) >= 2)
    pids = list(workers(proc.pid).values())
    assert len(pids) == 4
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.time()
    proc.wait()
    wait_for(lambda: not any(process_alive(p) for p in pids),
             timeout=HEARTBEAT_S * 3 + 30, every=0.1)
    took = time.time() - killed
    print(f"\nworkers gone {took:.1f} s after torchrun was killed")
    assert took <= HEARTBEAT_S / 4 + 5, took
