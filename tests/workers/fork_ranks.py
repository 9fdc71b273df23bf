"""Run a script on N local gloo ranks forked from one warm interpreter: a test launcher.

    python tests/workers/fork_ranks.py NPROC SCRIPT [ARG ...]

torchrun starts each rank as a new interpreter, and each one imports torch (~3 s of CPU) and
torch._dynamo (~3 s more: torch.optim imports it at an optimizer's first parameter group).
On the 2-core CI machine an 8-rank launch spends ~25 s on that before its first step. This
launcher pays it once: it imports train.py's modules and torch._dynamo, then forks the
ranks, each with the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the store), and runs SCRIPT in
each as `__main__` with ARG as its argv.

What the tests prove with it is the ranks' arithmetic, which does not depend on how the
processes started; what torchrun itself does (its error file, signals to the launcher, the
launcher's death) is tested through torchrun (tests/test_faults.py, tests/test_train_cli.py,
tests/test_readme_commands.py, tests/test_multinode.py). Like torchrun, the first rank to
fail ends the others, and the exit status is that rank's. Forking is safe here because the
parent has run no tensor arithmetic (no OpenMP pool) and holds no process group.
"""
import os
import runpy
import signal
import socket
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def warm_up() -> None:
    """Import what every rank imports, so that forked ranks find it loaded."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import train  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it at its first parameter group)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, nproc: int, port: int, script: str, args: list) -> int:
    """In the forked child: torchrun's worker environment, then the script; its exit code."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.argv = [script] + args
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(nproc: int, script: str, args: list) -> int:
    warm_up()
    port = free_port()
    children = {}
    for rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(run_rank(rank, nproc, port, script, args))
        children[pid] = rank
    status = 0
    while children:
        pid, wait_status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:   # the first failure ends the rest, as torchrun does
            status = code if code > 0 else 128 - code
            print(f"fork_ranks: rank {rank} exited with {code}; stopping the others",
                  file=sys.stderr, flush=True)
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]))
