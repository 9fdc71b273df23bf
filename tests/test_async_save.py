"""checkpoint.async_save, in one process: the files are written while training goes on, yet
the checkpoint holds the step it was taken at (the same tensors and state a synchronous save
writes) and resumes exactly; one save at a time; a writer's error surfaces at the next wait;
a crash lets the save in flight finish; a failed prune of keep_last only warns.
The 4-rank end-to-end run (train.py with async_save) is in tests/test_checkpoint_ranks.py."""
import os
import threading
import time

import pytest
import torch

from checkpoint_helpers import (build, content_of, same_content, save_at, step_state,
                                tiny_config, train_one, weights_of)
from tiny import one_process_group
import picotron.checkpoint.write as checkpoint_write
from picotron.checkpoint.async_save import CheckpointSaver
from picotron.checkpoint.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint


def held_writer(monkeypatch, gate: threading.Event, fail: str = None):
    """Make every shard write wait for `gate` (then fail with `fail`, if given)."""
    real = checkpoint_write.write_shard

    def write_shard(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        if fail:
            raise OSError(fail)
        return real(*args, **kwargs)
    monkeypatch.setattr(checkpoint_write, "write_shard", write_shard)


def test_an_async_save_holds_its_step_byte_for_byte_and_resumes_exactly(tmp_path,
                                                                       monkeypatch):
    config = tiny_config()
    model, grads, opt = build(config)
    for step in (1, 2):
        train_one(model, grads, opt, step)
    sync_dir = save_at(model, opt, config, str(tmp_path / "sync"), 2)
    at_step_2 = weights_of(model)
    gate = threading.Event()
    held_writer(monkeypatch, gate)
    saver = CheckpointSaver(async_save=True)
    async_dir = saver.save(model, opt, one_process_group(), config, str(tmp_path / "async"), 2,
                           step_state(config, 2))
    train_one(model, grads, opt, 3)          # training changes every weight and moment ...
    assert not os.path.exists(async_dir)     # ... while the files are still to be written
    gate.set()
    saver.wait()
    assert same_content(content_of(async_dir), content_of(sync_dir))   # state.json included
    assert resolve_checkpoint("latest", str(tmp_path / "async"), "/") == async_dir
    # Resume from it: the step-2 weights, and step 3 trains to the same weights.
    model2, grads2, opt2 = build(config, seed=5)
    load_checkpoint(async_dir, model2, opt2, one_process_group(), config)
    assert all(torch.equal(at_step_2[n], v) for n, v in weights_of(model2).items())
    train_one(model2, grads2, opt2, 3)
    assert all(torch.equal(weights_of(model)[n], v) for n, v in weights_of(model2).items())


def held_save_at_step_1(tmp_path, monkeypatch):
    """One step trained, then an async save of it whose files wait for the returned gate:
    (config, model, opt, saver, its save root, the checkpoint's directory, the gate)."""
    config = tiny_config()
    model, grads, opt = build(config)
    train_one(model, grads, opt, 1)
    gate = threading.Event()
    held_writer(monkeypatch, gate)
    saver, root = CheckpointSaver(async_save=True), str(tmp_path / "checkpoints")
    directory = saver.save(model, opt, one_process_group(), config, root, 1,
                           step_state(config, 1))
    return config, model, opt, saver, root, directory, gate


def test_one_save_in_flight_the_next_waits_for_it(tmp_path, monkeypatch):
    config, model, opt, saver, root, _, gate = held_save_at_step_1(tmp_path, monkeypatch)
    second = threading.Thread(target=saver.save, args=(model, opt, one_process_group(), config,
                                                       root, 2, step_state(config, 2)))
    second.start()
    second.join(1.0)
    assert second.is_alive() and not os.path.exists(os.path.join(root, "step_000002.tmp"))
    gate.set()                               # the first save finishes, then the second starts
    second.join(60)
    saver.wait()
    assert sorted(d for d in os.listdir(root) if d.startswith("step_")) == [
        "step_000001", "step_000002"]


def test_a_failed_write_surfaces_at_the_next_wait_and_is_never_latest(tmp_path, monkeypatch):
    config = tiny_config()
    model, grads, opt = build(config)
    train_one(model, grads, opt, 1)
    root = str(tmp_path / "checkpoints")
    save_at(model, opt, config, root, 1)
    gate = threading.Event()
    gate.set()
    held_writer(monkeypatch, gate, fail="No space left on device")
    saver = CheckpointSaver(async_save=True)
    saver.save(model, opt, one_process_group(), config, root, 2, step_state(config, 2))
    with pytest.raises(CheckpointError, match="saving checkpoint .*step_000002 failed .*rank 0: "
                                              "OSError: No space left on device"):
        saver.wait()
    assert resolve_checkpoint("latest", root, "/").endswith("step_000001")
    assert open(os.path.join(root, "latest")).read().strip() == "step_000001"
    monkeypatch.undo()                       # the disk has room again: the next save works
    saver.save(model, opt, one_process_group(), config, root, 2, step_state(config, 2))
    saver.wait()
    assert resolve_checkpoint("latest", root, "/").endswith("step_000002")


def test_a_crash_lets_the_save_in_flight_finish(tmp_path, monkeypatch, capsys):
    """train.py calls finish_writing when a step raises (or on Ctrl-C): the checkpoint taken
    before the crash is written, not abandoned with the daemon thread as the process ends."""
    _, _, _, saver, root, directory, gate = held_save_at_step_1(tmp_path, monkeypatch)
    threading.Timer(0.5, gate.set).start()   # the files are still being written at the crash
    saver.finish_writing()
    assert resolve_checkpoint("latest", root, "/") == directory
    assert "in flight when the run stopped, is complete" in capsys.readouterr().err


def test_a_save_whose_folder_is_removed_fails_at_once(tmp_path):
    """Rank 0 waits for every rank's marker; with `<dir>.tmp` gone the other ranks cannot
    even write one, so it says so at once instead of waiting distributed.timeout_s."""
    snap = checkpoint_write.Snapshot(str(tmp_path / "step_000001"), rank=0, world=2,
                                     keep_last=0, timeout_s=60.0)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="step_000001.tmp was removed while"):
        checkpoint_write._finish(snap)
    assert time.monotonic() - started < 5


def test_keep_last_and_a_resave_never_remove_a_file_and_a_failed_prune_only_warns(
        tmp_path, monkeypatch, capsys):
    config = tiny_config()
    config.checkpoint.keep_last = 1
    model, grads, opt = build(config)
    train_one(model, grads, opt, 1)
    root = str(tmp_path / "checkpoints")
    os.makedirs(root)
    with open(os.path.join(root, "step_000000"), "w") as f:     # a user's file, by its name
        f.write("notes")
    saver = CheckpointSaver(async_save=False)
    saver.save(model, opt, one_process_group(), config, root, 1, step_state(config, 1))
    assert open(os.path.join(root, "step_000000")).read() == "notes"

    def refuse(directory):
        raise PermissionError(f"cannot remove {directory}")
    monkeypatch.setattr(checkpoint_write, "remove_checkpoint", refuse)
    saver.save(model, opt, one_process_group(), config, root, 2, step_state(config, 2))
    assert resolve_checkpoint("latest", root, "/").endswith("step_000002")   # saved all the same
    assert "could not remove" in capsys.readouterr().err
    assert os.path.isdir(os.path.join(root, "step_000001"))
    monkeypatch.undo()        # a step saved again where a user's file has the step's name
    with open(os.path.join(root, "step_000003"), "w") as f:
        f.write("notes")
    with pytest.raises(CheckpointError, match="step_000003 is a file, where the checkpoint of "
                                              "that step goes; move it away"):
        saver.save(model, opt, one_process_group(), config, root, 3, step_state(config, 3))
    assert open(os.path.join(root, "step_000003")).read() == "notes"
