"""One run at a time in a run folder (picotron/run/run_lock.py): a second launch into an
owned folder is refused in one line naming the owner, at 1 rank and at 4, and the first run
goes on unharmed, writing each step once; a lock whose owner is gone (its pid on this host,
or a heartbeat too old on another host) is taken over with a warning; a SLURM job requeued
takes its own lock back; a lock of this process is its own."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import ROOT, free_port, write_config
from picotron.errors import ConfigError
from picotron.run import run_lock
from picotron.run.run_lock import RunLock, process_start
from test_faults import workers

ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
TINY = ["--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2", "--num_hidden_layers",
        "2", "--set", "training.warmup_steps=1", "--total_train_steps", "100000"]
HOLD = ("import sys, time; sys.path.insert(0, {root!r}); from picotron.run.run_lock import "
        "RunLock; w = RunLock({dir!r}).acquire(); print('held', w, flush=True); "
        "time.sleep(120)")


def hold_lock(folder, **env):
    """A process that takes the folder's lock and keeps it; returns it once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, dir=str(folder))],
                            env={**ENV, **env}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("held"), "the holder could not take the lock"
    return proc


def write_lock(folder, **owner):
    record = {"host": "some-host", "pid": 1, "process_start": None, "token": "x" * 32,
              "since": "2026-01-01T00:00:00+00:00", "argv": [], "slurm_job_id": None,
              "slurm_restart": 0, **owner}
    with open(os.path.join(folder, "run.lock"), "w") as f:
        json.dump(record, f)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_owner_is_refused_by_name_and_a_gone_one_taken_over(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(ConfigError) as refused:
            RunLock(str(tmp_path)).acquire()
        said = str(refused.value)
        assert "\n" not in said and f"pid {holder.pid} on host " in said, said
        assert f"the run folder {tmp_path} is in use by another run" in said
        assert "wait for it to end, or start this launch in another folder" in said
        assert "--set logging.run_dir=OTHER" in said
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(str(tmp_path))            # its pid is gone: taken over, with a warning
    warning = lock.acquire()
    assert warning and f"its process {holder.pid} on this host is gone" in warning, warning
    assert lock.holds()
    assert RunLock(str(tmp_path)).acquire() is None       # this process's own lock
    lock.release()
    assert not os.path.exists(os.path.join(tmp_path, "run.lock"))


def test_a_reused_pid_is_no_owner(tmp_path):
    import socket
    write_lock(tmp_path, host=socket.gethostname(), pid=os.getppid(),
               process_start=process_start(os.getppid()) + 1)   # alive, but started later
    assert "on this host is gone" in RunLock(str(tmp_path)).acquire()
    write_lock(tmp_path, host=socket.gethostname(), pid=dead_pid())
    assert "on this host is gone" in RunLock(str(tmp_path)).acquire()


def test_a_lock_on_another_host_is_stale_only_once_its_heartbeat_is_old(tmp_path):
    write_lock(tmp_path, host="node-17", pid=4242)
    with pytest.raises(ConfigError, match=r"pid 4242 on host node-17, started 2026-01-01.*"
                                          r"its heartbeat is \d+ s old\)"):
        RunLock(str(tmp_path)).acquire()
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(os.path.join(tmp_path, "run.lock"), (old, old))
    warning = RunLock(str(tmp_path)).acquire()
    assert warning and "its heartbeat is" in warning and "node-17 is gone" in warning, warning


def test_a_requeued_slurm_job_takes_its_own_lock_back(tmp_path):
    holder = hold_lock(tmp_path, SLURM_JOB_ID="777", SLURM_RESTART_COUNT="0")
    try:
        again = [sys.executable, "-c", HOLD.format(root=ROOT, dir=str(tmp_path))
                 .replace("time.sleep(120)", "pass")]
        second = subprocess.run(again, env={**ENV, "SLURM_JOB_ID": "777",
                                            "SLURM_RESTART_COUNT": "0"},
                                capture_output=True, text=True)       # another srun: refused
        assert second.returncode != 0 and "is in use by another run" in second.stderr
        assert "SLURM job 777" in second.stderr
        requeued = subprocess.run(again, env={**ENV, "SLURM_JOB_ID": "777",
                                              "SLURM_RESTART_COUNT": "1"},
                                  capture_output=True, text=True)
        assert requeued.returncode == 0, requeued.stderr
        assert "SLURM job 777's own, from before its requeue" in requeued.stdout
    finally:
        holder.kill()
        holder.wait()


def start_run(path, nproc):
    """train.py on `nproc` ranks (torchrun above 1) in its own session, output in files."""
    folder = os.path.dirname(path)
    stamp = f"{time.time():.6f}"
    train = [os.path.join(ROOT, "train.py"), "--config", path,
             "--set", "checkpoint.load_path=latest"]        # the command a user repeats
    cmd = ([sys.executable] + train if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port())] + train)
    out, err = (open(os.path.join(folder, f"{n}.{stamp}.txt"), "w+") for n in ("out", "err"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=err, text=True,
                            start_new_session=True)
    proc.files = (out, err)
    return proc


def output(proc):
    texts = []
    for f in proc.files:
        f.flush()
        f.seek(0)
        texts.append(f.read())
    return texts


def logged_steps(path):
    metrics = os.path.join(os.path.dirname(path), "metrics.jsonl")
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        return [json.loads(x)["step"] for x in f if x.strip() and '"loss"' in x]


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_second_launch_into_a_running_folder_is_refused_and_the_first_unharmed(tmp_path,
                                                                                 nproc):
    layout = ["--dp", "2", "--tp", "2"] if nproc == 4 else []
    path = write_config(tmp_path, "run", TINY + layout)
    first = start_run(path, nproc)
    try:
        end = time.time() + 180
        while len(logged_steps(path)) < 2 and time.time() < end and first.poll() is None:
            time.sleep(0.1)
        assert len(logged_steps(path)) >= 2, output(first)
        with open(os.path.join(os.path.dirname(path), "run.lock")) as f:
            owner = json.load(f)["pid"]        # one lock for the launch: its rank 0's
        assert owner == (first.pid if nproc == 1 else workers(first.pid)[0]), owner
        second = start_run(path, nproc)
        second.wait(timeout=180)
        out, err = output(second)
        said = [x for x in (out + err).splitlines() if x.startswith("error")]
        assert second.returncode != 0 and len(said) == 1, (out, err)
        assert said[0].startswith(f"error: the run folder {os.path.dirname(path)} is in use "
                                  f"by another run: pid "), said
        # torchrun's closing report is its own traceback; none comes from the project's code
        assert "picotron/" not in err and 'train.py", line' not in err, err
        assert "resumed" not in out and (nproc > 1 or "Traceback" not in err), (out, err)
        assert first.poll() is None, "the first run ended"
        before = len(logged_steps(path))
        time.sleep(1.0)
        os.killpg(first.pid, signal.SIGTERM)       # a scheduler's notice: stop and save
        first.wait(timeout=120)
        out, err = output(first)
        # one process: 143; torchrun, signalled itself, exits 1 once its workers stopped
        assert first.returncode == (143 if nproc == 1 else 1), (out[-2000:], err[-3000:])
        assert "stopped by SIGTERM after step" in out, out[-2000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    steps = logged_steps(path)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > before, steps
    assert not os.path.exists(os.path.join(os.path.dirname(path), "run.lock"))  # released


def test_a_launch_into_a_folder_whose_lock_was_left_by_a_killed_run_takes_it_over(tmp_path):
    """A run killed (kill -9) leaves its lock; the next launch takes it over, says so in one
    warning, trains, and removes the lock at its end."""
    import socket
    path = write_config(tmp_path, "run", TINY[:-2] + ["--total_train_steps", "2"])
    gone = dead_pid()
    write_lock(os.path.dirname(path), host=socket.gethostname(), pid=gone)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", path],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [x for x in done.stderr.splitlines() if x.startswith("warning: took over")]
    assert warned == [f"warning: took over the run folder's lock {os.path.dirname(path)}/"
                      f"run.lock from pid {gone} on host {socket.gethostname()}, started "
                      f"2026-01-01T00:00:00+00:00: its process {gone} on this host is gone"], (
                          done.stderr[-3000:])
    assert not os.path.exists(os.path.join(os.path.dirname(path), "run.lock"))
