"""Helpers for tests that run training: write a config, launch it, read what it wrote."""
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import create_config  # noqa: E402
from picotron.checkpoint.checkpoint import load_full_weights  # noqa: E402
from picotron.utils import process_gone  # noqa: E402


def write_config(tmp_path, name: str, args: list) -> str:
    """create_config.py with `args` (its command-line flags) into tmp_path/name/config.json."""
    return create_config.main(["--out_dir", str(tmp_path), "--exp_name", name, "--use_cpu"] + args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (exists and is no zombie)."""
    return not process_gone(pid)


def launch(config_path: str, nproc: int, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py as a user does: plain python for one rank, torchrun for more; it fails
    by raising."""
    train = os.path.join(ROOT, "train.py")
    if nproc == 1:
        return _run([sys.executable, train, "--config", config_path], timeout)
    return torchrun_script(train, nproc, ["--config", config_path], timeout)


def launch_many(config_paths: list, nproc: int, timeout: int = 1200):
    """Train every config, in order, in one launch of `nproc` gloo ranks
    (tests/workers/train_many.py): the interpreter and torch start-up are paid once."""
    return launch_script(os.path.join(ROOT, "tests", "workers", "train_many.py"), nproc,
                         config_paths, timeout)


def read_metrics(config_path: str) -> list:
    with open(os.path.join(os.path.dirname(config_path), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def final_weights(config_path: str) -> dict:
    """The full weights of the last checkpoint of the run (needs checkpoint.save_frequency)."""
    ckpt_root = os.path.join(os.path.dirname(config_path), "checkpoints")
    last = sorted(d for d in os.listdir(ckpt_root) if d.startswith("step_"))[-1]
    return load_full_weights(os.path.join(ckpt_root, last))


def launch_script(script: str, nproc: int, args=(), timeout: int = 600):
    """Run a script on `nproc` gloo ranks forked from the session's warm interpreter
    (tests/workers/fork_ranks.py: torchrun's worker environment without its ~6 s of imports
    per rank and launch); it fails by raising."""
    argv = [os.path.abspath(script), *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="picotron-launch-") as logs:
        request = {"nproc": nproc, "script": argv[0], "args": argv[1:], "cwd": ROOT,
                   "env": _env(), "out": os.path.join(logs, "out"),
                   "err": os.path.join(logs, "err")}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, \
                conn.makefile("rw") as stream:
            conn.connect(_rank_server())
            conn.settimeout(timeout)
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            pid = json.loads(stream.readline())["pid"]
            try:
                code = json.loads(stream.readline())["rc"]
            except socket.timeout:
                os.killpg(pid, signal.SIGKILL)
                code = f"killed after its {timeout} s timeout"
        out, err = (_read(request[k]) for k in ("out", "err"))
    return _checked(subprocess.CompletedProcess(["fork_ranks", str(nproc)] + argv, code, out,
                                                err))


def _read(path: str) -> str:
    """A launch's output file ('' when the launch failed before it could write one)."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


_SERVER = {}


def _rank_server() -> str:
    """The socket of this session's launch server, started at the first launch."""
    proc = _SERVER.get("proc")
    if proc is None or proc.poll() is not None:
        folder = tempfile.mkdtemp(prefix="picotron-ranks-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "workers",
                                                              "fork_ranks.py"), "--serve", path],
                                env=_env(), cwd=ROOT)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        atexit.register(proc.kill)  # runs first (atexit is last in, first out)
        while not os.path.exists(path):
            if proc.poll() is not None:
                raise AssertionError(f"the launch server exited {proc.returncode}")
            time.sleep(0.05)
        _SERVER.update(proc=proc, path=path)
    return _SERVER["path"]


def torchrun_script(script: str, nproc: int, args=(), timeout: int = 600):
    """Run a script on `nproc` gloo ranks with torchrun itself; it fails by raising."""
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                 "--master_port", str(free_port()), script, *map(str, args)], timeout)


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))


def _run(cmd: list, timeout: int) -> subprocess.CompletedProcess:
    return _checked(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   env=_env(), cwd=ROOT))


def _checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc
