"""The forking test launcher (tests/workers/fork_ranks.py, through tests/launch.py's
launch_script) gives each rank torchrun's worker environment and fails as torchrun does: a
rank's error fails the launch, stops the other ranks, and comes back in the error message; a
launch past its timeout is killed with all its ranks. The parity tests rely on it."""
import json
import time

import pytest

from launch import ROOT, launch_script, process_alive

RANKS = """
import json, os, sys, time
rank = int(os.environ["RANK"])
line = json.dumps({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} | {"argv": sys.argv[1:],
                  "pid": os.getpid(), "cwd": os.getcwd()})
# The ranks share one output file: one write() per line, so that lines never interleave
# (print makes two, the text and its newline, when Python's output is unbuffered).
os.write(1, (line + "\\n").encode())
open(os.path.join(os.path.dirname(__file__), f"started.{rank}"), "w").close()
if rank == int(sys.argv[1]):           # once every rank has started
    while len([f for f in os.listdir(os.path.dirname(__file__)) if f.startswith("started")]) \
            < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)
    raise ValueError(f"rank {rank} fails on purpose")
time.sleep(float(sys.argv[2]))
"""


def write_script(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(RANKS)
    return str(path)


def test_ranks_get_torchrun_environment_and_argv(tmp_path):
    out = launch_script(write_script(tmp_path), 3, [-1, 0]).stdout
    ranks = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["RANK"])
    assert [(r["RANK"], r["LOCAL_RANK"]) for r in ranks] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"], r["MASTER_PORT"],
             tuple(r["argv"])) for r in ranks} == {("3", "3", "127.0.0.1", ranks[0]["MASTER_PORT"],
                                                   ("-1", "0"))}
    assert len({r["pid"] for r in ranks}) == 3 and {r["cwd"] for r in ranks} == {ROOT}


def test_a_failing_rank_fails_the_launch_and_stops_the_others(tmp_path):
    start = time.time()
    with pytest.raises(AssertionError, match="rank 1 fails on purpose") as failed:
        launch_script(write_script(tmp_path), 3, [1, 600])
    assert time.time() - start < 60          # the sleeping ranks did not sleep 600 s
    pids = [json.loads(line)["pid"] for line in str(failed.value).splitlines()
            if line.startswith("{")]
    assert len(pids) == 3 and not any(process_alive(p) for p in pids)


def test_a_launch_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    with pytest.raises(AssertionError, match="killed after its 5 s timeout") as late:
        launch_script(write_script(tmp_path), 2, [-1, 600], timeout=5)
    pids = [json.loads(line)["pid"] for line in str(late.value).splitlines()
            if line.startswith("{")]
    assert len(pids) == 2
    deadline = time.time() + 10
    while any(process_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(p) for p in pids)
