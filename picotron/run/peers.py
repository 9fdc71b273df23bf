"""The watchdog's view of the other ranks (picotron/run/watchdog.py): which run on this
machine, by their process ids (published in the launcher's store), and which of them has
exited without finishing the run: died (kill -9, a crash in C: it said nothing), or stopped
on its own with a reason it left in the store (`DONE_KEY`), which a survivor relays once.
"""
import json
import socket

import torch.distributed as dist

from picotron.utils import process_gone

STOP_KEY, BEAT_KEY, PROCESS_KEY, DONE_KEY = "stop", "heartbeat/", "process/", "done/"
SIGINT_KEY = "sigint"        # set by the first rank that hears a SIGINT
STOPS_TOO = "; this rank stops too"


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because a peer is gone (gloo raises RuntimeError, naming its
    transport; NCCL and the store raise torch's DistError)."""
    text = str(error)
    return isinstance(error, dist.DistError) or isinstance(error, RuntimeError) and any(
        s in text for s in ("gloo/transport", "Connection closed by peer",
                            "Connection reset by peer", "Broken pipe"))


class LocalPeers:
    """peers = LocalPeers(rank, world, store, call), `call(store.method, *args)` making each
    store call (the watchdog's, which ends the run when the store stops answering)."""

    def __init__(self, rank: int, world: int, store, call):
        self.rank, self.world, self.store, self.call = rank, world, store, call
        self.known = {}                 # rank -> pid on this machine, or None elsewhere

    def pids(self) -> dict:
        """{rank: pid} of the other ranks on this machine, read once all have published."""
        if len(self.known) < self.world - 1 and self.call(
                self.store.check, [f"{PROCESS_KEY}{r}" for r in range(self.world)]):
            host = socket.gethostname()
            for r in range(self.world):
                where, pid = json.loads(self.call(self.store.get, f"{PROCESS_KEY}{r}"))
                if r != self.rank:
                    self.known[r] = pid if where == host else None
        return {r: pid for r, pid in self.known.items() if pid is not None}

    def gone(self, died_only: bool):
        """(rank, what happened) of a peer on this machine that has exited without finishing
        the run, or None. A rank that exits on its own (an error it reports, a stop) says so
        first (the watchdog's close, or at exit); one that says nothing died."""
        for r, pid in self.pids().items():
            if not process_gone(pid):
                continue
            if not self.call(self.store.check, [f"{DONE_KEY}{r}"]):
                return r, f"rank {r} (pid {pid}) died"
            outcome = self.call(self.store.get, f"{DONE_KEY}{r}").decode()
            if outcome != "finished" and not died_only:     # relayed: its reason said once
                return r, f"rank {r} {outcome.removesuffix(STOPS_TOO)}"
        return None
