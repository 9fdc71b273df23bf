"""Faults on 4 gloo ranks, as a cluster produces them, each timed, each ended by one line on
every rank (torchrun writes each rank's output to its own files here), and each resumed
exactly.

- kill -9 of one rank during a step, and during a checkpoint write: every other rank names
  the dead rank at once, even while it waits on it in a collective or for its checkpoint files
  (picotron/run/watchdog.py), and `--set checkpoint.load_path=latest` continues to the same
  losses and weights as a run never interrupted;
- SIGTERM to torchrun (a scheduler's notice) and Ctrl-C (SIGINT to the whole process group, as
  a terminal sends it): every rank stops after the same step, a checkpoint is saved, one line
  says so, the status is 143 / 130, and the resume is exact; a second Ctrl-C while a rank is
  blocked stops at once, and what it left is never taken for a checkpoint;
- a frozen rank (SIGSTOP) under distributed.timeout_s=30: the others name it within the
  derived heartbeat (15 s) plus one interval, before their collectives time out;
- kill -9 of torchrun itself: its workers exit, each with one line;
- a save that cannot start (its directory cannot be made): every rank stops with one message
  naming the checkpoint and the fix, and the checkpoints before it resume exactly.
Two layouts share the cases: dp2 x tp2, and dp2 x pp2. The detection times are printed
(`pytest -s`), and docs/reliability.md quotes them."""
import glob
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


def config_for(tmp_path, name, layout, heartbeat_s=HEARTBEAT_S, timeout_s=60):
    beat = [] if heartbeat_s is None else ["--set", f"distributed.heartbeat_s={heartbeat_s}"]
    return write_config(tmp_path, name, LAYOUTS[layout] + beat + [
        "--dataset_name", "synthetic", "--seq_len", "32", "--mbs", "2", "--grad_acc_steps", "2",
        "--num_hidden_layers", "2", "--total_train_steps", str(STEPS),
        "--set", "training.warmup_steps=2", "--set", "checkpoint.save_frequency=2",
        "--set", f"distributed.timeout_s={timeout_s}"])


def start(config_path, *extra, script=os.path.join(ROOT, "train.py")):
    """torchrun on 4 ranks of `script`, in its own session (so a test can signal all of it),
    each rank's output in its own files (`rank_output`)."""
    logs = os.path.dirname(config_path)          # files, not pipes: a full pipe blocks a rank
    stamp = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), "--log-dir", os.path.join(logs, f"ranks.{stamp}"),
           "--redirects", "3", script, "--config", config_path, *extra]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    out, err = (open(os.path.join(logs, f"{n}.{stamp}.txt"), "w+") for n in ("out", "err"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True,
                            start_new_session=True)
    proc.out_file, proc.err_file = out, err
    proc.rank_logs = os.path.join(logs, f"ranks.{stamp}")
    return proc


def rank_output(proc, rank: int) -> str:
    """What rank `rank` printed, stdout then stderr."""
    text = ""
    for stream in ("stdout", "stderr"):
        for path in glob.glob(os.path.join(proc.rank_logs, "**", "attempt_*", str(rank),
                                           f"{stream}.log"), recursive=True):
            with open(path) as f:
                text += f.read()
    return text


def last_lines(proc) -> dict:
    """{rank: its output's last line}, after checking that no rank printed a traceback."""
    out = {r: rank_output(proc, r) for r in range(4)}
    for r, text in out.items():
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, (r, text[-3000:])
    return {r: (text.strip().splitlines() or [""])[-1] for r, text in out.items()}


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
         ("dp2-tp2", "ctrl-c"), ("dp2-pp2", "ctrl-c"), ("dp2-tp2", "save-fails")]


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
    hit, pids = time.time(), workers(proc.pid)
    if fault.startswith("kill"):
        os.kill(pids[2], signal.SIGKILL)
    elif fault == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    elif fault == "ctrl-c":          # a terminal's Ctrl-C: torchrun and every worker
        os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc)
    took = time.time() - hit
    print(f"\n{layout} {fault}: torchrun exited {rc} after {took:.1f} s")
    assert rc != 0 and took < 30, (rc, took, err[-3000:])
    ends = last_lines(proc)
    if fault.startswith("kill"):     # every other rank names the dead one, in one line
        for r in (0, 1, 3):
            assert ends[r].startswith(f"error (rank {r}, step ") and (
                f"rank 2 (pid {pids[2]}) died" in ends[r]) and "load_path=latest" in ends[r], (
                    r, rank_output(proc, r)[-2000:])
        assert took < 10, took       # the survivors of a save do not wait for torchrun's 30 s
    if fault in ("sigterm", "ctrl-c"):   # every rank stopped after one step, and saved it
        said = [x for r in range(4) for x in rank_output(proc, r).splitlines()
                if x.startswith("stopped by")]
        name = "SIGTERM" if fault == "sigterm" else "Ctrl-C (SIGINT)"
        assert len(said) == 1 and said[0].startswith(f"stopped by {name} after step"), said
        stopped = int(said[0].split(" after step ")[1].split(":")[0])
        assert os.path.isdir(os.path.join(root, f"step_{stopped:06d}")), said
        assert f"checkpoint {root}/step_{stopped:06d} saved" in said[0], said
        assert not [line for r in range(4) for line in rank_output(proc, r).splitlines()
                    if line.startswith("error")], "a stop is no error"
    if fault == "save-fails":        # said once, by rank 0, with no rank's traceback
        said = [x for r in range(4) for x in rank_output(proc, r).splitlines()
                if x.startswith("error")]
        assert len(said) == 1 and "could not start checkpoint" in said[0], said
        assert "step_000006" in said[0] and "load_path=latest" in said[0], said
        assert logged_steps(path) == 6 and os.path.isdir(os.path.join(root, "step_000004"))
        os.remove(blocker)
    assert logged_steps(path) < STEPS, "the fault came too late to test anything"
    resume_and_compare(path, uninterrupted[layout])


def test_a_second_ctrl_c_stops_a_blocked_run_at_once(tmp_path, uninterrupted):
    """Rank 1 frozen: the others block in a collective, so the first Ctrl-C's stop cannot
    come; the second (later than 2 s) ends them at once, with one line, and the resume from
    `latest` takes only complete checkpoints."""
    path = config_for(tmp_path, "run", "dp2-tp2")
    proc = start(path)
    wait_for(lambda: logged_steps(path) >= 5)
    pids = workers(proc.pid)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2.5)
        second = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        wait_for(lambda: not any(process_alive(pids[r]) for r in (0, 2, 3)), timeout=10)
        took = time.time() - second
    finally:
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[1], signal.SIGCONT)
        finish(proc)
    print(f"\nranks 0, 2, 3 gone {took:.1f} s after the second Ctrl-C")
    assert took < 3, took
    said = [x for r in (0, 2, 3) for x in rank_output(proc, r).splitlines() if x.strip()]
    assert len([x for x in said if "second Ctrl-C" in x]) == 1, said
    assert not [x for x in said if x.startswith("error")], said
    resume_and_compare(path, uninterrupted["dp2-tp2"])


def test_a_frozen_rank_is_named_before_the_collective_timeout(tmp_path):
    """distributed.timeout_s=30 and heartbeat_s unset (min(60, 30 / 2) = 15 s): the frozen
    rank is named, with the step it stopped at, before gloo's timeout would fire."""
    path = config_for(tmp_path, "frozen", "dp2-pp2", heartbeat_s=None, timeout_s=30)
    proc = start(path, "--set", f"training.total_train_steps={STEPS * 50}")
    wait_for(lambda: logged_steps(path) >= 3)
    time.sleep(1.0)                    # two of the watchdog's ticks: rank 1 has beaten since
    frozen = workers(proc.pid)[1]
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        line = wait_for(lambda: next((x for r in (0, 2, 3) for x in rank_output(
            proc, r).splitlines() if "no heartbeat" in x), None), timeout=60, every=0.2)
        took = time.time() - stopped_at
        others = [p for r, p in workers(proc.pid).items() if r != 1]
        wait_for(lambda: not any(process_alive(p) for p in others), timeout=30, every=0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        os.kill(frozen, signal.SIGCONT)
        proc.wait()
    print(f"\nfrozen rank 1 named after {took:.1f} s: {line}")
    assert "rank 1 has sent no heartbeat" in line and "it stopped beating after step" in line, line
    # rank 1 logs the steps (the last stage's first rank), each once the next one is queued
    # or at a save: it had finished the steps it logged, and at most one more
    beat = int(line.split("stopped beating after step ")[1].split(";")[0])
    logged = logged_steps(path)
    assert 3 <= logged <= beat <= logged + 1, (line, logged)
    assert took <= 15 * 1.25 + 5 < 30, took     # heartbeat_s + 1 interval, < timeout_s
    ends = last_lines(proc)
    assert all("no heartbeat" in ends[r] or "died" in ends[r] for r in (0, 2, 3)), ends


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
    assert took <= 5, took
    ends = last_lines(proc)
    assert all(ends[r].startswith(f"error (rank {r}, step ") and "launcher" in ends[r]
               for r in range(4)), ends
