"""Faults a run must notice: a rank that died or froze, a launcher that died, a SIGTERM.

Without this, a frozen rank (stopped, swapped out, its GPU hung) is noticed only when a
collective waiting for it passes `distributed.timeout_s` (300 s by default), and then by a
healthy rank, whose timeout is what the launcher reports; a dead launcher leaves its workers
training unsupervised; a SIGTERM (what a cluster scheduler sends before it kills a job)
throws away every step since the last checkpoint.

- Heartbeat. A thread on every rank writes `(time, step)` under its rank in the launcher's
  key-value store every `heartbeat_s / 4` seconds, and reads everyone else's. A rank whose
  heartbeat is older than `distributed.heartbeat_s` is dead or frozen: the thread prints
  which rank, its last step and how long it has been silent, writes the same to torchrun's
  error file and ends this process (status 3). The thread runs beside the training thread
  (torch's ops release the GIL), so a long step or a checkpoint write never looks like a
  freeze; a stopped or dead process writes nothing. Detection takes at most heartbeat_s
  plus one interval (tests/test_faults.py measures it).
- The launcher. The same thread checks that the process's parent is still the one that
  started it; when torchrun is killed, its workers exit (status 3) instead of training on.
- SIGTERM. The handler only raises a flag and publishes a stop step in the store (two steps
  ahead, the first writer wins), so every rank stops after the same step, however many
  steps apart their signals arrived; train.py then saves a checkpoint (when
  `checkpoint.save_on_sigterm`) and exits with status 143, like a process killed by SIGTERM.
"""
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

STOP_KEY, BEAT_KEY = "picotron/stop_after_step", "picotron/heartbeat/"


def launcher_store():
    """A client of torchrun's key-value store (the one the process group rendezvoused
    through), or None when this process was not started by a launcher."""
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=30))


class Watchdog:
    """watchdog = Watchdog(config); watchdog.start(); each step: watchdog.step = k, and
    `if watchdog.stop_requested(k): save and exit`; at the end, watchdog.close()."""

    def __init__(self, config):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.limit = config.distributed.heartbeat_s
        self.step, self.stop_step, self.sigterm = 0, None, False
        self.parent = os.getppid()
        self.store = launcher_store() if self.world > 1 else None
        self.closed = threading.Event()

    def start(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.store is not None or "RANK" in os.environ:
            threading.Thread(target=self._watch, name="picotron-watchdog", daemon=True).start()

    def close(self) -> None:
        self.closed.set()

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm = True
        if self.store is not None:    # the first rank to hear it picks the step all stop after
            self.store.compare_set(STOP_KEY, "", str(self.step + 2))

    def stop_requested(self, step: int) -> bool:
        """True once step `step` (counted from 1, just finished) is the one to stop after."""
        if not self.sigterm and (self.store is None or not self.store.check([STOP_KEY])):
            return False
        if self.stop_step is None:
            self.stop_step = int(self.store.get(STOP_KEY)) if self.store else step
        return step >= self.stop_step

    def _watch(self) -> None:
        every = self.limit / 4
        first_seen = {}           # rank -> when this rank first looked for its heartbeat
        while not self.closed.wait(every):
            if os.getppid() != self.parent:
                self._fail(f"the launcher (pid {self.parent}) is gone; this worker stops "
                           f"instead of training unsupervised")
            if self.store is None:
                continue
            now = time.time()
            self.store.set(f"{BEAT_KEY}{self.rank}", json.dumps([now, self.step]))
            for r in range(self.world):
                if r == self.rank:
                    continue
                key = f"{BEAT_KEY}{r}"
                if self.store.check([key]):
                    beat, step = json.loads(self.store.get(key))
                else:                       # not started beating yet: count from now
                    beat, step = first_seen.setdefault(r, now), None
                if now - beat > self.limit:
                    at = f"its last step was {step}" if step is not None else "it never beat"
                    self._fail(f"rank {r} has sent no heartbeat for {now - beat:.1f} s "
                               f"(distributed.heartbeat_s={self.limit:g}); {at}: it died or "
                               f"froze. Resume with --set checkpoint.load_path=latest")

    def _fail(self, message: str) -> None:
        """Say why once, where torchrun's report will show it, and end this process now
        (the training thread may be blocked in a collective that will never return)."""
        text = f"error (rank {self.rank}, step {self.step}): {message}"
        print(text, file=sys.stderr, flush=True)
        tell_launcher(text)
        os._exit(3)


def tell_launcher(text: str) -> bool:
    """Write `text` to torchrun's error file (TORCHELASTIC_ERROR_FILE), in the format its
    closing report reads back, so the report shows it as this rank's failure instead of "To
    enable traceback...". False when no launcher asked for one."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    with open(error_file, "w") as f:
        json.dump({"message": {"message": text, "extraInfo": {
            "py_callstack": text, "timestamp": str(int(time.time()))}}}, f)
    return True
