"""train.py run as a script whose checkpoint writes after the first one take a minute, so a
test can kill a rank while an asynchronous save is in flight: its `step_N.tmp` exists, and
`latest` still names the checkpoint before it.

    torchrun ... tests/workers/slow_save_run.py [train.py flags...]

Only the files' writing waits (in the background writer, checkpoint.async_save=true); the
snapshot, with its collectives, runs as always."""
import os
import runpy
import sys
import time

from picotron.checkpoint import async_save

write, written = async_save.write_snapshot, []


def slow_after_the_first(snap):
    if written:
        time.sleep(60)
    written.append(snap.directory)
    write(snap)


async_save.write_snapshot = slow_after_the_first
train = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "train.py")
sys.argv = [train, *sys.argv[1:]]
runpy.run_path(train, run_name="__main__")
