"""What the survivors of a fault say names what happened (tests/test_faults.py times the
faults and checks the resumes): the checkpoint `latest` names after a kill during an
asynchronous save, not the save in flight; the rank that hosted the store when the ranks were
started without torchrun, not the launcher; Ctrl-C when the launcher passed it on to some ranks
as SIGTERM; and each phrase once, a stop relayed from rank to rank included."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from launch import ROOT, free_port
from picotron.run.peers import DONE_KEY, PROCESS_KEY, LocalPeers
from picotron.run.watchdog import Watchdog
from test_faults import (config_for, finish, last_lines, logged_steps, rank_output, start,
                         wait_for, workers)


def said_once(line: str) -> bool:
    """No phrase of a message (its parts between '; ') is said twice."""
    parts = [p.strip() for p in line.split(";")]
    return len(parts) == len(set(parts))


def test_a_kill_during_an_async_save_names_the_checkpoint_latest_names(tmp_path):
    path = config_for(tmp_path, "async", "dp2-tp2")
    root = os.path.join(tmp_path, "async", "checkpoints")
    proc = start(path, "--set", "checkpoint.async_save=true",
                 script=os.path.join(ROOT, "tests", "workers", "slow_save_run.py"))
    wait_for(lambda: os.path.isdir(os.path.join(root, "step_000004.tmp")), every=0.05)
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step_000002"     # the first save, complete
    pids = workers(proc.pid)
    os.kill(pids[2], signal.SIGKILL)
    rc, _, err = finish(proc)
    ends = last_lines(proc)
    for r in (0, 1, 3):
        assert ends[r].startswith(f"error (rank {r}, step ") and (
            f"rank 2 (pid {pids[2]}) died" in ends[r]), (r, rank_output(proc, r)[-2000:])
        assert ends[r].endswith(f"(the last complete checkpoint: {root}/step_000002)"), ends[r]
        assert said_once(ends[r]), ends[r]
    assert not os.path.exists(os.path.join(root, "step_000004"))


def test_without_torchrun_a_dead_rank_0_is_named_as_the_store_s_host(tmp_path):
    """Ranks started as plain processes (rank 0 hosts the store, their parent lives on):
    after kill -9 of rank 0 the others name it, not a launcher."""
    path = config_for(tmp_path, "plain", "dp2-tp2")
    port, folder = free_port(), os.path.dirname(path)
    procs = []
    for rank in range(4):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        err = open(os.path.join(folder, f"err.{rank}.txt"), "w+")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                                       "--config", path], cwd=ROOT, env=env, stdout=err,
                                      stderr=err, text=True, start_new_session=True))
        procs[-1].err = err
    try:
        wait_for(lambda: logged_steps(path) >= 3, timeout=180)
        procs[0].kill()
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for rank, p in enumerate(procs[1:], start=1):
        p.err.seek(0)
        text = p.err.read()
        line = text.strip().splitlines()[-1]
        assert "Traceback" not in text and p.returncode == 3, (rank, text[-3000:])
        assert line.startswith(f"error (rank {rank}, step "), line
        assert (f"the rank that hosted the store (rank 0, pid {procs[0].pid}) died; this rank "
                f"stops too" in line) and "launcher" not in line, line
        assert said_once(line), line


def test_ctrl_c_passed_on_as_sigterm_to_some_ranks_is_said_as_ctrl_c(tmp_path):
    """torchrun, hearing Ctrl-C twice (the terminal's and a wrapper's copy) while it passes on
    the first, sends SIGTERM to every rank: the ranks it had not reached hear SIGTERM alone,
    and may ask for the stop first. Here every rank hears SIGTERM first, one rank SIGINT."""
    path = config_for(tmp_path, "ctrl-c", "dp2-tp2")
    proc = start(path, "--set", "training.total_train_steps=200")
    wait_for(lambda: logged_steps(path) >= 3)
    pids = workers(proc.pid)
    for r in range(4):
        os.kill(pids[r], signal.SIGTERM)
    time.sleep(0.02)
    os.kill(pids[3], signal.SIGINT)
    rc, _, err = finish(proc)
    said = [x for r in range(4) for x in rank_output(proc, r).splitlines()
            if x.startswith("stopped by")]
    assert len(said) == 1 and said[0].startswith("stopped by Ctrl-C (SIGINT) after step"), said
    assert "failed (exitcode: 130)" in err, err[-3000:]        # the first rank to end: 130


class Store:
    """A launcher's store, as a dict."""

    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


def test_a_stop_relayed_from_rank_to_rank_is_said_once():
    """Rank 0 saw rank 2 die and stopped, saying so in the store; rank 1's collective then
    fails, and it relays rank 0's reason: "this rank stops too" once, not twice."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store = Store()
    for r, pid in ((0, gone.pid), (1, os.getpid()), (2, os.getpid())):
        store.set(f"{PROCESS_KEY}{r}", json.dumps([socket.gethostname(), pid]))
    store.set(f"{DONE_KEY}0", "stopped: rank 2 (pid 4242) died; this rank stops too")
    watchdog, said = Watchdog.__new__(Watchdog), []
    watchdog.store = store
    watchdog.peers = LocalPeers(1, 3, store, lambda call, *args: call(*args))
    watchdog._fail = said.append
    watchdog.collective_failed(RuntimeError("Connection closed by peer"))
    assert said == ["a collective failed: rank 0 stopped: rank 2 (pid 4242) died; this rank "
                    "stops too"], said


def test_a_frozen_rank_is_named_within_heartbeat_s_with_its_silence_and_last_step():
    """The watchdog's reading of beats (picotron/run/heartbeats.py), on a simulated clock: a
    peer finishes a step every 0.3 s and beats at each, then freezes. It is named at most
    heartbeat_s after it froze, by the step it last beat at and a silence that holds the true
    one (its last beat is known only to lie between two checks)."""
    import re
    from picotron.run.heartbeats import Heartbeats
    for freeze in (10.0, 10.2, 11.1, 12.9):        # against the reader's 3.75 s schedule
        beats, last, named = Heartbeats(0, 15.0), None, None
        for tick in range(6000):
            now = tick * 0.01
            if now < freeze and tick % 30 == 0:       # a step done: it beats
                last = (now, json.dumps([tick // 30 + 1, tick // 30]))
            if beats.due(now):
                named = beats.check({1: last[1].encode()}, now)
                if named:
                    break
        assert named and now - freeze <= 15.0, (freeze, now, named)
        found = re.search(r"for (\d+\.\d)(?:-(\d+\.\d))? s", named)
        least, most = float(found.group(1)), float(found.group(2) or found.group(1))
        assert least - 0.05 <= now - last[0] <= most + 0.05, (now - last[0], named)
        assert said_once(named) and named.endswith(f"after step {json.loads(last[1])[1]}"), named
