"""Faults a run must notice, each ended by one line naming the rank, the step and the fix.

Without this, a frozen rank (stopped, swapped out, its GPU hung) is noticed only when a
collective waiting for it passes `distributed.timeout_s` (300 s by default), and then by a
healthy rank, whose timeout is what the launcher reports; a dead launcher leaves its workers
training unsupervised; a dead peer shows as a backend's traceback on every rank; a SIGTERM (a
scheduler's notice) or a Ctrl-C throws away every step since the last checkpoint. A GPU that
runs out of memory ends in one line too, with what the memory plan says would fit.

A thread on every rank (`Watchdog`) watches; torch's ops release the GIL, so it runs beside
the training thread, and a long step or a checkpoint write never looks like a freeze.
At least twice a second (heartbeats.QUIET_TICK_S) it:
- reads the signals the main thread cannot handle while blocked (picotron/run/stop_signals.py);
- checks the peers on this machine by their process ids (published in the launcher's store):
  a rank that died is named at once, even while this one waits on it in a collective or in a
  checkpoint write;
- checks that this process's parent is still the launcher that started it.
It beats (a counter and its step, under its rank, in the launcher's store) at each new step
and every `heartbeat_s / 4`, when it also reads everyone else's beat. A beat unchanged for
`heartbeat_s` is a dead or frozen rank, on any machine (picotron/run/heartbeats.py: named
within heartbeat_s of freezing, plus a loaded machine's delay, inside the stated bound
heartbeat_s + heartbeat_s / 4), so heartbeat_s defaults to min(60, timeout_s / 2) and is
refused at timeout_s / 1.25 or above (picotron/config/checks.py): a frozen rank is named
before its peers' collectives time out. It also renews the run folder's lock
(picotron/run/run_lock.py), and releases it at the end.
A store that stops answering is the launcher gone, or, without torchrun, rank 0 (its host).

Stops every rank agrees on (a signal, a diverged loss) go through the store: the first rank to
ask publishes the step all stop after, two ahead of its own (a rank can be one step ahead of
another, never two), and every rank checks for it after each step (`stop_requested`).
"""
import atexit
import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from picotron.checkpoint.verify import latest_written
from picotron.config.checks import heartbeat_seconds
from picotron.run.heartbeats import Heartbeats
from picotron.run.launcher import launcher_store, tell_launcher
from picotron.run.peers import (BEAT_KEY, DONE_KEY, PROCESS_KEY, SIGINT_KEY, STOP_KEY,
                                STOPS_TOO, LocalPeers, is_peer_failure)
from picotron.plan.memory_plan import out_of_memory_message
from picotron.run.stop_signals import AT_ONCE_AFTER_S, NAMES, StopSignals
from picotron.utils import process_gone

RESUME = "resume with --set checkpoint.load_path=latest"
_running = None             # this process's started, not yet closed, Watchdog


class _Closed(Exception):
    """A store call failed after close(): the launcher may go once the run is over."""


def end_if_known_failure(error: BaseException) -> None:
    """For the exception leaving train.py: a collective that failed because a peer is gone,
    or the GPU out of memory, ends with the watchdog's one line instead of a traceback."""
    if _running is None:
        return
    if is_peer_failure(error):
        _running.collective_failed(error)
    if isinstance(error, torch.OutOfMemoryError):
        device = torch.device("cuda", torch.cuda.current_device())
        _running._fail(out_of_memory_message(error, _running.config, device))


class Watchdog:
    """watchdog = Watchdog(config, is_logger); watchdog.start(); after each step k:
    watchdog.step = k; `if watchdog.stop_requested(k)`: save per `watchdog.stop` and exit; at
    the end watchdog.close(); a collective that failed: watchdog.collective_failed(error)."""
    runs = 0                                # Watchdogs made in this process so far

    def __init__(self, config, is_logger: bool, run_lock=None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.config = config                # for the out-of-memory message's fixes
        self.is_logger, self.run_lock = is_logger, run_lock    # the run folder's lock
        self.limit = heartbeat_seconds(config.distributed)
        self.signals, self.first_sigint = StopSignals(), None
        self.step, self.stop, self.stop_step = 0, None, None   # stop: (reason, message)
        self.last_checkpoint = None     # the newest checkpoint started (maybe still in flight)
        self.parent = os.getppid()
        self.launched = "RANK" in os.environ
        # torchrun's agent hosts the store; a launcher without one leaves it to rank 0
        self.store_host = ("the launcher" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
                           == "True" else "rank 0")
        Watchdog.runs += 1                  # the same count on every rank
        self.store = launcher_store(Watchdog.runs) if self.world > 1 else None
        self.closed, self.failing = threading.Event(), threading.Lock()
        self.peers = LocalPeers(self.rank, self.world, self.store, self._store)
        self.beats = Heartbeats(self.rank, self.limit)

    @property
    def step(self) -> int:
        """The steps this rank has finished; setting it wakes the thread, which beats it."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self.signals.wake()

    def start(self) -> None:
        global _running
        self.signals.install()
        if self.store is not None:
            self._store(self.store.set, f"{PROCESS_KEY}{self.rank}",
                        json.dumps([socket.gethostname(), os.getpid()]))
        atexit.register(self.close, "exited (its own output says why)")
        _running = self
        threading.Thread(target=self._watch, name="picotron-watchdog", daemon=True).start()

    def close(self, outcome: str = "finished") -> None:
        """The run ended here (`outcome`: "finished", or how it ended): peers that outlive
        this rank do not take its exit for a death. Main thread; also called at exit."""
        global _running
        if self.closed.is_set():
            return
        self.closed.set()
        self._tell_peers(outcome)
        if self.run_lock is not None:
            self.run_lock.release()
        self.signals.wake()
        self.signals.restore()
        atexit.unregister(self.close)
        _running = None

    # ---- stops every rank agrees on -----------------------------------------------------
    def request_stop(self, reason: str, message: str = "") -> None:
        """Ask every rank to stop after the same step (any thread). `reason`: a signal's
        name or "diverged"; the first request wins."""
        if self.stop is not None:
            return
        self.stop = (reason, message)
        if self.store is not None:
            value = json.dumps([self.step + 2, reason, message])
            self._store(self.store.compare_set, STOP_KEY, "", value)

    def stop_requested(self, step: int) -> bool:
        """True once step `step` (counted from 1, just finished) is the one to stop after;
        `self.stop` then says why."""
        if self.stop_step is None:
            if self.store is not None and self._store(self.store.check, [STOP_KEY]):
                self.stop_step, reason, message = json.loads(self._store(self.store.get,
                                                                         STOP_KEY))
                self.stop = (reason, message)
            elif self.store is None and self.stop is not None:
                self.stop_step = step
        if self.stop_step is None or step < self.stop_step:
            return False
        # Ctrl-C passed on as SIGTERM: at a second signal (a wrapper's copy of a Ctrl-C) while
        # it passes on the first, torchrun sends SIGTERM to all: ranks not reached yet hear it
        # alone, and may ask first. Any SIGINT wins.
        if self.stop[0] == "SIGTERM" and (self.first_sigint is not None or self.store is not
                                          None and self._store(self.store.check, [SIGINT_KEY])):
            self.stop = ("SIGINT", NAMES[signal.SIGINT])
        return True

    # ---- the thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        with contextlib.suppress(_Closed):     # a store call after close(): the run is over
            self._watch_until_closed()

    def _watch_until_closed(self) -> None:
        while not self.closed.is_set():
            for signum in self.signals.received():
                self._on_signal(signum)
            if self.closed.is_set():
                break
            if self.launched and os.getppid() != self.parent:
                if self.first_sigint:
                    self._stop_at_once()       # a second Ctrl-C that ended the launcher
                self._fail(f"the launcher (pid {self.parent}) is gone; this worker stops "
                           f"instead of training unsupervised", tell_peers=False)
            if self.run_lock is not None:
                self.run_lock.refresh()        # its heartbeat, every run_lock.REFRESH_S
            if self.store is not None:
                self._check_local_peers()
                now = time.monotonic()
                due = self.beats.due(now)
                if due or self.step != self.beats.beaten_step:      # a new step: at once
                    self._store(self.store.set, f"{BEAT_KEY}{self.rank}",
                                self.beats.next_beat(self.step))
                if due:
                    self._check_beats(now)
            select.select([self.signals], [], [], self.beats.wait_s(time.monotonic()))

    def _on_signal(self, signum) -> None:
        now = time.monotonic()
        if self.first_sigint is not None and now - self.first_sigint >= AT_ONCE_AFTER_S:
            self._stop_at_once()           # a second Ctrl-C, or torchrun's SIGTERM after it
        if signum.name == "SIGINT" and self.first_sigint is None:
            self.first_sigint = now
            if self.store is not None:
                self._store(self.store.set, SIGINT_KEY, "heard")
        self.request_stop(signum.name, NAMES[signum])

    def _stop_at_once(self) -> None:
        """A second Ctrl-C: end now. A checkpoint being written stays a `.tmp` folder, which
        no resume takes (picotron/checkpoint/find.py)."""
        with self.failing:
            if self.is_logger:
                last = self._last_complete() or "none yet"
                print(f"stopped at once by a second Ctrl-C during step {self.step + 1}; "
                      f"nothing more is saved (a save in progress is left unfinished, never "
                      f"taken); the last complete checkpoint: {last}; {RESUME}",
                      file=sys.stderr, flush=True)
            self._tell_peers("stopped at once by a second Ctrl-C")
            os._exit(130)

    def _check_local_peers(self) -> None:
        gone = self.peers.gone(died_only=True)
        if gone is not None:
            self._fail(f"{gone[1]}{STOPS_TOO}")

    def _check_beats(self, now: float) -> None:
        """Fail on a running peer whose beat has not changed for heartbeat_s (`now`: read
        before the beats are)."""
        beats = {}
        for r in range(self.world):
            if r == self.rank or self._store(self.store.check, [f"{DONE_KEY}{r}"]):
                continue
            key = f"{BEAT_KEY}{r}"
            beats[r] = self._store(self.store.get, key) if self._store(self.store.check,
                                                                       [key]) else None
        silent = self.beats.check(beats, now)
        if silent:
            self._fail(silent)

    # ---- ending ----------------------------------------------------------------------------
    def collective_failed(self, error: BaseException) -> None:
        """Main thread: a collective raised because a peer is gone. Name the peer when it can
        be seen (a process on this machine; up to 3 s for its exit to show), then end."""
        time.sleep(0.2)    # a signal that came with the failure is the thread's to act on
        deadline, gone = time.monotonic() + 3.0, None
        while self.store is not None and gone is None and time.monotonic() < deadline:
            gone = self.peers.gone(died_only=False)
            time.sleep(0.05)
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        what = gone[1] if gone else f"a peer's connection failed ({type(error).__name__}: {text})"
        self._fail(f"a collective failed: {what}{STOPS_TOO}")

    def _last_complete(self):
        """The checkpoint `latest` names beside the last one this launch started (a save in
        flight is not one until its rename), or None."""
        if self.last_checkpoint is None:
            return None
        root = os.path.dirname(self.last_checkpoint)
        name = latest_written(root)
        return os.path.join(root, name) if name else None

    def _store(self, call, *args):
        """A store call; a store that stops answering means the launcher is gone."""
        try:
            return call(*args)
        except Exception as e:              # noqa: BLE001 - torch's store errors vary
            if self.closed.is_set():
                raise _Closed() from e
            self._fail(self._store_gone(e), tell_peers=False)

    def _store_gone(self, error: Exception) -> str:
        what = f"the key-value store stopped answering ({type(error).__name__})"
        if self.store_host == "the launcher":
            return (f"{what}: the launcher (pid {self.parent}) is gone or unreachable; this "
                    f"worker stops instead of training unsupervised")
        pid = self.peers.known.get(0)
        how = (f"(rank 0, pid {pid}) died" if pid is not None and process_gone(pid)
               else "(rank 0) is gone or unreachable")
        return f"{what}: the rank that hosted the store {how}{STOPS_TOO}"

    def _fail(self, message: str, tell_peers: bool = True) -> None:
        """Say why once, with how to resume, where torchrun's report will show it, and end
        this process now (the training thread may be blocked in a collective that will never
        return). `tell_peers`: leave the cause in the store, for the ranks that outlive this."""
        with self.failing:
            complete = self._last_complete()
            last = f" (the last complete checkpoint: {complete})" if complete else ""
            text = f"error (rank {self.rank}, step {self.step}): {message}; {RESUME}{last}"
            print(text, file=sys.stderr, flush=True)
            tell_launcher(text)
            if tell_peers:
                self._tell_peers(f"stopped: {message}")
            os._exit(3)

    def _tell_peers(self, outcome: str) -> None:
        """Leave why this rank ends in the store, for the ranks that outlive it to relay. A
        store's set is not answered: a check, which is, makes sure it landed before an exit."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"{DONE_KEY}{self.rank}", outcome)
                self.store.check([f"{DONE_KEY}{self.rank}"])
