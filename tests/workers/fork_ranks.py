"""A test launcher: N local gloo ranks forked from one warm interpreter, instead of torchrun's
N fresh ones.

    python tests/workers/fork_ranks.py NPROC SCRIPT [ARG ...]     # one launch
    python tests/workers/fork_ranks.py --serve SOCKET              # launches on request

torchrun starts each rank as a new interpreter, and each one imports torch (~3 s of CPU) and
torch._dynamo (~3 s more: torch.optim imports it at an optimizer's first parameter group).
On the 2-core CI machine an 8-rank launch spends ~25 s on that before its first step. Here
the imports are paid once: train.py's modules and torch._dynamo are imported, then the ranks
are forked, each with the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the store), and each runs SCRIPT
as `__main__` with ARG as its argv. With --serve, a server imports once for the whole test
session (tests/launch.py starts it): each request on the UNIX socket forks a launch (its own
session, working directory, environment and output files) that forks the ranks; the server
answers the launch's pid at once, its exit status when it ends.

What the tests prove with it is the ranks' arithmetic, which does not depend on how the
processes started; what torchrun itself does (its error file, signals to the launcher, the
launcher's death) is tested through torchrun (tests/test_faults.py, tests/test_train_cli.py,
tests/test_readme_commands.py, tests/test_multinode.py). Like torchrun, the first rank to
fail ends the others, and the exit status is that rank's. Forking is safe because the
forking process has run no tensor arithmetic (no OpenMP pool) and holds no process group.
Environment variables read at import time (TRITON_INTERPRET) are the server's.
"""
import json
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


def fork_ranks(nproc: int, script: str, args: list) -> int:
    """Fork the ranks, wait for them all; the first failure ends the rest, as in torchrun."""
    from launch import free_port        # importable once warm_up has put tests/ on sys.path
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
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            print(f"fork_ranks: rank {rank} exited with {code}; stopping the others",
                  file=sys.stderr, flush=True)
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


def start_launch(request: dict, *inherited) -> int:
    """Fork one launch of `request` (nproc, script, args, cwd, env, out, err); its pid."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        for s in inherited:
            s.close()
        os.setsid()                      # the client may kill the launch and its ranks at once
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["out"]), (2, request["err"])):
            with open(path, "w") as f:
                os.dup2(f.fileno(), fd)
        status = fork_ranks(request["nproc"], request["script"], request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve(path: str) -> None:
    """Answer launch requests one at a time until the client (the test session) is gone."""
    owner = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(1.0)
    while os.getppid() == owner:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        with conn:
            with conn.makefile("r") as stream:
                pid = start_launch(json.loads(stream.readline()), server, conn)
            send(conn, {"pid": pid})
            send(conn, {"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])})


def send(conn, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:                      # the client gave up on the launch (its timeout)
        pass


if __name__ == "__main__":
    warm_up()
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        sys.exit(fork_ranks(int(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]))
