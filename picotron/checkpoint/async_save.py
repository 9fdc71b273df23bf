"""Saving checkpoints while training goes on (`checkpoint.async_save`).

A save has two halves (picotron/checkpoint/write.py): the snapshot, on the main thread, with
every collective and the copies of the step's tensors to host memory; then the files. With
`async_save` the files are written by a background thread while the next steps train; without
it, right away, as before. Either way the same code writes the same bytes, with the same
atomicity: `<dir>.tmp`, state.json last, the rename, then `latest`.

At most one save is in flight: the next save, and the end of training, first wait for it.
That wait is collective (every rank calls it at the same step): the ranks exchange what their
writers raised, so a failed write (a full disk, a rank that died) surfaces on every rank at
once, as one error naming the checkpoint, never lost in a thread. The checkpoints
written before it stay intact: a failed save never becomes `latest`.
"""
import os
import sys
import threading

import torch.distributed as dist

from picotron.checkpoint.verify import STATE_FILE
from picotron.checkpoint.write import HostBuffers, take_snapshot, write_snapshot
from picotron.checkpoint.shards import SharedCheckpointError


class CheckpointSaver:
    """`save(...)` at a step boundary, `wait()` at the end of training; both on every rank."""

    def __init__(self, async_save: bool):
        self.async_save = async_save
        self.buffers = HostBuffers(copies=async_save)   # host copies only for the background
        self.thread = None
        self.pending = None              # the directory of the save not yet waited for
        self.error = None                # what this rank's writer raised, as text
        self.timeout_s = self.rank = None   # distributed.timeout_s, this rank: at a save

    def save(self, model, optimizer, pgm, config, save_root: str, step: int,
             state: dict) -> str:
        """Snapshot now (collective), write now or in the background; the checkpoint's path.
        `state`: tokens_seen, data (position), accepted_changes."""
        self.wait()                      # one in flight: the host copies are free again
        snap = take_snapshot(model, optimizer, pgm, config, save_root, step, state,
                             self.buffers)
        self.timeout_s, self.rank = snap.timeout_s, snap.rank
        self.pending = snap.directory
        if self.async_save:
            self.thread = threading.Thread(target=self._write, args=(snap,), daemon=True,
                                           name=f"checkpoint-writer-{step}")
            self.thread.start()
        else:
            self._write(snap)
            self.wait()
        return snap.directory

    def _write(self, snap) -> None:
        try:
            write_snapshot(snap)
        except Exception as e:           # kept for wait(), which every rank reaches
            self.error = f"{type(e).__name__}: {e}"

    def finish_writing(self) -> None:
        """Not collective: on a crash (or Ctrl-C), let the save in flight write its files, which
        come from host copies the crash cannot touch, so the checkpoint taken before it is not
        lost. Bounded, as any save, by distributed.timeout_s (rank 0 waits for every rank's)."""
        if self.thread is None:
            return
        self.thread.join(timeout=self.timeout_s)
        if self.thread.is_alive() or self.error is not None:
            return
        if self.rank == 0 and os.path.isfile(os.path.join(self.pending, STATE_FILE)):
            print(f"checkpoint {self.pending}, in flight when the run stopped, is complete",
                  file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Collective: finish the save in flight; if any rank's writer failed, raise on all."""
        if self.pending is None:
            return
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, self.error)
        directory, self.pending, self.error = self.pending, None, None
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise SharedCheckpointError(
                f"saving checkpoint {directory} failed ({'; '.join(failed)}); it was not made "
                f"the latest, the checkpoints before it are intact: fix the cause, then resume "
                f"with --set checkpoint.load_path=latest")
