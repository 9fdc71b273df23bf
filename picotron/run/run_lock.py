"""One run at a time in a run folder: `<run dir>/run.lock`, taken before anything is written.

Two launches into one folder (a command run twice, a job started again while the first still
runs) would each write every step into metrics.jsonl and the same checkpoints, and both end
"done". So rank 0 takes the folder's lock at start, right after the folders are checked and
before any file is written, and tells the other ranks of its launch through the process group
(`claim_run_dir`): every rank of one launch shares the lock, and a launch whose rank 0 is
refused is refused on all of its ranks. The lock file holds its owner: host, pid, the
process's start (so a reused pid is not taken for the owner), when it was taken, the command,
and SLURM's job id and restart count where SLURM started it.

A launch into an owned folder is refused in one line naming the owner and the ways out. A lock
whose owner is gone is taken over, with a warning:
- on this host: its pid is gone (or now belongs to a process started at another time);
- on another host, where no pid can be checked: its heartbeat is older than `STALE_AFTER_S`.
  The heartbeat is the file's modification time, which the owner's watchdog thread renews
  every `REFRESH_S` (picotron/run/watchdog.py);
- SLURM: a lock of the same job id taken at a lower restart count (SLURM_RESTART_COUNT) is
  the job's own, from before a requeue: the job takes it back.
It is removed when its run ends (the watchdog's close, or at exit); a run killed (kill -9, a
rank's failure ending it at once) leaves it for the next launch to take over.

What is atomic, on a shared filesystem too. The owner is written into a file of a unique name
beside the lock, which is then hard-linked to `run.lock`: `link` fails if that name exists,
in one operation on local filesystems, NFS (v2 to v4: the server makes the link) and Lustre
(its metadata server serialises it), and the owner can be read as soon as the lock exists.
A retried NFS LINK whose first reply was lost can answer "exists" after it succeeded, so the
unique file's link count decides (2: ours). Where hard links are not supported (some FUSE and
SMB mounts), `open(O_CREAT | O_EXCL)` makes the lock instead: atomic locally, on NFS v3 and
later and on Lustre, not on NFS v2; an empty lock younger than `STALE_AFTER_S` then counts as
being written by its owner. Not atomic: taking over a stale lock renames it aside, then links
anew; two launches that judged the same stale lock can race there, so the one that renamed
checks it moved the file it judged (its inode) and otherwise puts it back and tries again. A
third launch in that instant could still slip between the two. The heartbeat compares a file
time set by the file server's clock (NFS) with this host's clock, and NFS clients cache file
attributes (up to 60 s by default): STALE_AFTER_S allows for both; clocks further apart than
it make a live owner on another host look gone.
"""
import atexit
import datetime
import json
import os
import socket
import sys
import time
import uuid

import torch.distributed as dist

from picotron.errors import ConfigError
from picotron.run.output_paths import check_output_dirs

LOCK_NAME = "run.lock"
REFRESH_S = 30.0            # the owner renews the lock's modification time this often
STALE_AFTER_S = 300.0       # a lock on another host unrenewed this long: its owner is gone
TRIES = 5                   # takeovers raced by other launches before giving up


def process_start(pid: int):
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22), or
    None where /proc does not say: with the pid, it names one process, not its pid's reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, started) -> bool:
    """Whether the process `pid` that started at `started` (process_start's) runs here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process: alive, and its start not readable
        return True
    now = process_start(pid)
    return started is None or now is None or now == started


class RunLock:
    """lock = RunLock(run_dir); warning = lock.acquire() (ConfigError when another run owns
    the folder); lock.refresh() now and then; lock.release() at the end."""

    def __init__(self, run_dir: str):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK_NAME)
        self.owner, self.refreshed = None, 0.0     # our record while we hold it

    def acquire(self):
        """Take the lock; returns a warning when a gone owner's lock was taken over, else
        None. Raises ConfigError naming the owner when a live run holds it."""
        warnings = []
        for _ in range(TRIES):
            if self._create():
                return "; ".join(warnings) or None
            owner, stat = self._read()
            if stat is None:                       # removed meanwhile: try again
                continue
            verdict, why = self._judge(owner, stat)
            if verdict == "ours":
                self.owner = owner
                return None
            if verdict == "live":
                raise ConfigError(self._owned_message(owner, why))
            if self._take_over(stat):
                warnings.append(f"took over the run folder's lock {self.path} from "
                                f"{describe(owner)}: {why}")
        raise ConfigError(f"could not take the run folder's lock {self.path}: other launches "
                          f"took it over at the same moment {TRIES} times; start one launch "
                          f"per run folder")

    def _create(self) -> bool:
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "process_start": process_start(os.getpid()), "token": uuid.uuid4().hex,
                  "since": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"), "argv": sys.argv[:8],
                  "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                  "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
        text = json.dumps(record) + "\n"
        unique = f"{self.path}.{record['host']}.{record['pid']}.{record['token'][:8]}"
        with open(unique, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            try:
                os.link(unique, self.path)
                linked = True
            except FileExistsError:
                linked = os.stat(unique).st_nlink == 2     # a retried NFS LINK that succeeded
            except OSError:                                # no hard links here
                linked = self._create_exclusive(text)
        finally:
            os.unlink(unique)
        if linked:
            self.owner, self.refreshed = record, time.monotonic()
            atexit.register(self.release)
        return linked

    def _create_exclusive(self, text: str) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def _read(self):
        """(the owner's record or None if unreadable, os.stat of the lock or None if gone)."""
        try:
            stat = os.stat(self.path)
            with open(self.path) as f:
                owner = json.loads(f.read())
            return (owner if isinstance(owner, dict) else None), stat
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, stat

    def _judge(self, owner, stat):
        """("ours" | "live" | "stale", why) for the lock held by `owner`."""
        age = time.time() - stat.st_mtime
        if owner is None:      # being written (O_EXCL), or damaged: judged by its age
            return (("stale", f"it is unreadable and {age:.0f} s old") if age > STALE_AFTER_S
                    else ("live", "its owner is writing it"))
        here = owner.get("host") == socket.gethostname()
        if here and owner.get("pid") == os.getpid() and owner.get(
                "process_start") == process_start(os.getpid()):
            return "ours", ""        # this process trains this folder again (several runs)
        job = os.environ.get("SLURM_JOB_ID")
        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        if job and owner.get("slurm_job_id") == job and owner.get("slurm_restart", 0) < restart:
            return "stale", (f"it is SLURM job {job}'s own, from before its requeue (restart "
                             f"{owner.get('slurm_restart', 0)}, now {restart})")
        pid = owner.get("pid")
        if here and isinstance(pid, int) and pid > 0:
            if pid_alive(pid, owner.get("process_start")):
                return "live", "its process runs on this host"
            return "stale", f"its process {owner.get('pid')} on this host is gone"
        if age > STALE_AFTER_S:
            return "stale", (f"its heartbeat is {age:.0f} s old, above {STALE_AFTER_S:g} s "
                             f"(its run on {owner.get('host')} is gone)")
        return "live", f"its heartbeat is {age:.0f} s old"

    def _take_over(self, judged) -> bool:
        """Move the stale lock `judged` (its os.stat) aside; True if it was that one."""
        aside = f"{self.path}.stale.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False                    # another launch moved it first
        moved = os.stat(aside)
        if (moved.st_ino, moved.st_dev) != (judged.st_ino, judged.st_dev):
            try:                            # a launch's fresh lock: put it back
                os.link(aside, self.path)
            except OSError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        return True

    def _owned_message(self, owner, why: str) -> str:
        return (f"the run folder {self.run_dir} is in use by another run: "
                f"{describe(owner)} ({why}); wait for it to end, or start this launch in "
                f"another folder (create_config.py --exp_name OTHER, or --set "
                f"logging.run_dir=OTHER); if that run is surely gone, remove {self.path}")

    def holds(self) -> bool:
        """Whether the lock file is still ours (no other launch took it over)."""
        owner, _ = self._read()
        return bool(self.owner and owner and owner.get("token") == self.owner["token"])

    def refresh(self) -> None:
        """Renew the heartbeat (the file's modification time) if REFRESH_S has passed. A
        lock another launch took over (it judged this run gone) is said once, then left."""
        if self.owner is None or time.monotonic() - self.refreshed < REFRESH_S:
            return
        self.refreshed = time.monotonic()
        if not self.holds():
            owner, _ = self._read()
            print(f"warning: the run folder's lock {self.path} is now held by "
                  f"{describe(owner)}, which took it over; two runs now write into "
                  f"{self.run_dir}", file=sys.stderr, flush=True)
            self.owner = None
            return
        try:
            os.utime(self.path)
        except OSError:
            pass

    def release(self) -> None:
        if self.owner is not None and self.holds():
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.owner = None
        atexit.unregister(self.release)


def describe(owner) -> str:
    if not owner:
        return "a launch whose record cannot be read"
    slurm = f", SLURM job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started "
            f"{owner.get('since')}{slurm}")


_held = {}       # run dir -> this process's RunLock (a process may train several runs)


def claim_run_dir(config, run_dir: str) -> RunLock:
    """Collective. Refuse a run whose outputs cannot be written (check_output_dirs), then
    take the run folder's lock on rank 0 and tell every rank of this launch: a folder owned by
    another run is refused on every rank alike. Returns the lock (rank 0's; a handle that
    holds nothing on the other ranks), for the watchdog to renew and release."""
    check_output_dirs(config, run_dir)
    lock = _held.setdefault(os.path.abspath(run_dir), RunLock(os.path.abspath(run_dir)))
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [("taken", lock.acquire())]
        except ConfigError as e:
            outcome = [("refused", str(e))]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    verdict, text = outcome[0]
    if verdict == "refused":
        raise ConfigError(text)
    if text and dist.get_rank() == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)
    return lock
