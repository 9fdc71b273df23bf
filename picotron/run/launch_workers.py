"""`python train.py --nproc_per_node N --config ...`: train.py starts its own workers, through
torch's elastic launcher (torch.distributed.launcher's `elastic_launch`, what torchrun runs),
and ends as a worker would: the root cause's one line, said once by the workers themselves,
and their exit status (2 a refused config, 130 Ctrl-C, 143 SIGTERM).

torchrun starts the same workers, then adds its own report to every failure: a
ChildFailedError box naming each rank's exit code (the ranks it terminated itself included),
a SignalException traceback after a Ctrl-C, and status 1 whatever the workers said. Here the
launch flags are torchrun's own, read by torchrun's own parser (`torch.distributed.run`), so
a flag means what it means there; only the end differs:
- a worker that exited with a status of its own (it printed why): that status, nothing added;
- workers killed by a signal nobody handled (kill -9, the kernel's out-of-memory killer): one
  line naming the first of them, status 128 + the signal's number;
- a Ctrl-C or SIGTERM to the launcher: torch's agent passes the signal on to every worker
  (they stop after the same step and save, picotron/run/watchdog.py), and the launcher ends
  with the workers' status for it, 130 or 143, quietly;
- the launcher itself failing (a rendezvous that times out): one line, status 1.

Without a GPU, and under the static rendezvous (one machine, or --master_addr), the workers
are forked from this process (torchrun's `--run-path
--start-method fork`), which has imported train.py's modules and torch._dynamo (torch.optim
imports it at an optimizer's first parameter group): each fresh rank would import them again,
~5 s of CPU, which 16 ranks on 2 cores pay as ~37 s before their first step (bench/NOTES.md,
"Where a 16-rank start's time goes"). Forking is safe here because this process has run no
tensor arithmetic (no OpenMP pool), holds no process group and never touched CUDA. Forked
workers share the terminal's process group: a Ctrl-C reaches each of them directly and again
from torch's agent within milliseconds, which picotron/run/stop_signals.py counts as one press.
With a GPU visible the workers are fresh processes, as torchrun starts them: CUDA does not
survive a fork once any CUDA call (even a device count) was made. So are they under the c10d
rendezvous, where 16 forked workers waited on a store that never answered.
"""
import logging
import os
import signal
import socket
import sys

# the flags that launch, spelled as torchrun spells them: (flag, metavar, help)
LAUNCH_FLAGS = [
    ("--nproc_per_node", "N", "start N worker processes on this machine (one per GPU, or CPU "
     "processes with use_cpu) and train through them, as torchrun would; the config's "
     "dp*tp*pp*cp must equal N x nodes"),
    ("--nnodes", "N", "machines taking part (default 1); each runs this same command with "
     "its --node_rank, or with the same --rdzv_endpoint and --rdzv_id"),
    ("--node_rank", "R", "this machine's place among --nnodes, 0 first (static rendezvous)"),
    ("--master_addr", "HOST", "node 0's address, for the static rendezvous (default 127.0.0.1)"),
    ("--master_port", "PORT", "node 0's free port, for the static rendezvous"),
    ("--rdzv_backend", "NAME", "rendezvous backend: static (with --master_addr), c10d"),
    ("--rdzv_endpoint", "HOST:PORT", "where the c10d rendezvous is hosted"),
    ("--rdzv_id", "ID", "a job id the nodes of one launch share (c10d rendezvous)"),
]
# a one-machine launch with no address given meets on a free port (as torchrun's --standalone,
# but through the static rendezvous), so two runs on one machine never meet at one port
LAUNCHER_LOGS = ("torch.distributed", "torch.multiprocessing")     # the launcher's loggers
ADDRESS_FLAGS = ("master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id")


def add_launch_flags(parser) -> None:
    group = parser.add_argument_group(
        "launching the workers (torchrun's flags; `torchrun ... train.py` works as well)")
    for flag, metavar, text in LAUNCH_FLAGS:
        group.add_argument(flag, metavar=metavar, help=text)


def wants_launch(args) -> bool:
    """Whether any launch flag was given: this process starts the workers."""
    return any(getattr(args, flag[2:]) is not None for flag, _, _ in LAUNCH_FLAGS)


def torchrun_argv(args, script: str, worker_args: list, fork: bool = False) -> list:
    """The command line torchrun would have been given for this launch (`fork`: workers forked
    from this process, which runs `script` in each)."""
    given = {flag: getattr(args, flag[2:]) for flag, _, _ in LAUNCH_FLAGS}
    argv = [f"{flag}={value}" for flag, value in given.items() if value is not None]
    if fork:     # runpy.run_path(script) in a forked copy of this process
        argv += ["--run-path", "--start-method=fork"]
    single_node = str(args.nnodes or 1) == "1"
    if single_node and all(getattr(args, name) is None for name in ADDRESS_FLAGS):
        argv.append(f"--master_port={free_port()}")
    return argv + [script, *worker_args]


def free_port() -> int:
    """A port no one listens on now, on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(args, script: str) -> int:
    """Start `script --config ... --set ...` (train.py's own command line, less the launch
    flags) on every worker of this launch, wait for them, and return the status to exit with."""
    worker_args = ["--config", args.config] + [a for s in args.set for a in ("--set", s)]
    if "RANK" in os.environ:
        print("error: the launch flags (--nproc_per_node, ...) are for the command you type; "
              "this process is already a worker of a launcher (torchrun): drop them",
              file=sys.stderr, flush=True)
        return 2
    import torch
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # forked workers under the c10d rendezvous hung at 16 ranks (their store never answered):
    # there, and with a GPU, the workers are fresh processes
    fork = args.rdzv_backend in (None, "static") and not torch.cuda.is_available()
    if fork:
        import torch._dynamo  # noqa: F401  (every rank's optimizer imports it: once, here)
    parser = torchrun.get_args_parser()
    parser.error = lambda message: _refused(message)
    launch = parser.parse_args(torchrun_argv(args, script, worker_args, fork))
    _quiet()
    try:
        config, cmd, cmd_args = torchrun.config_from_args(launch)
        elastic_launch(config, run_forked if fork else cmd)(*cmd_args)
    except ChildFailedError as e:
        return _workers_status(e.failures)
    except SignalException as e:             # the workers were sent it, and stopped
        return 128 + int(e.sigval)
    except (RuntimeError, ValueError, AssertionError) as e:     # the rendezvous, its options
        print(f"error: the launcher failed: {type(e).__name__}: {_first_line(e)}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def run_forked(script: str, *script_args: str) -> None:
    """A forked worker: the signal handlers of a fresh process (the agent's, copied by the
    fork, would turn the SIGTERM that ends a worker into a SignalException traceback), then
    torchrun's run_script_path (`script` as __main__, with `script_args` as its argv), then
    the exit handlers, which a process forked by multiprocessing skips (it ends in os._exit):
    the watchdog's tells the other ranks that this one ended on purpose."""
    import atexit
    from torch.distributed.run import run_script_path
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        run_script_path(script, *script_args)
    finally:
        atexit._run_exitfuncs()


def _workers_status(failures: dict) -> int:
    """The status of a failed launch: the first worker that exited with a status of its own
    (it said why; the ranks torch's agent then terminated are no cause), else the first
    killed by a signal, named here in one line. `failures`: {rank: ProcessFailure}."""
    by_time = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    for rank, failure in by_time:
        if failure.exitcode > 0:
            return failure.exitcode
    rank, failure = by_time[0]
    name = signal.Signals(-failure.exitcode).name
    print(f"error: rank {rank} (pid {failure.pid}) was killed by {name} (by no part of this "
          f"run: another program, the out-of-memory killer?); the other workers were stopped; "
          f"resume with --set checkpoint.load_path=latest", file=sys.stderr, flush=True)
    return 128 - failure.exitcode


def _quiet() -> None:
    """torch's launcher logs each signal it passes on, each worker it closes and each failure,
    to stderr through the handlers of the "torch" and "torch.distributed" loggers; the
    workers already say how the run ended, and the launcher's own failures are raised
    (`launch_workers` says them), so in this process those records are dropped."""
    launcher = os.getpid()              # forked workers keep torch's logs as torchrun's do

    def keep(record) -> bool:
        return os.getpid() != launcher or not record.name.startswith(LAUNCHER_LOGS)
    for name in ("torch", *LAUNCHER_LOGS):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(keep)


def _refused(message: str):
    print(f"train.py: error: {message}; --help lists every flag", file=sys.stderr, flush=True)
    sys.exit(2)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
