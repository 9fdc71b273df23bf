"""Single-process training on CPU: the learning-rate schedule, a CPU run never touches CUDA,
a crash still logs every finished step. (That the debug model learns and logs every metric
docs/outputs.md lists is checked on the README's quick start, tests/test_readme_commands.py.)"""
import json

import pytest
import torch

import create_config
import train
from picotron.config import TrainingConfig
from picotron.utils import lr_at


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainingConfig(learning_rate=1e-3, min_lr_ratio=0.1, warmup_steps=10,
                         total_train_steps=100)
    lrs = [lr_at(s, cfg) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))        # non-increasing after warm-up
    assert lrs[-1] == pytest.approx(1e-4)


def test_cpu_run_never_touches_cuda(tmp_path, monkeypatch, capsys):
    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"a use_cpu run called torch.cuda.{name}")
        return call             # one object per name: torch._dynamo indexes them by identity
    for name in ("is_available", "set_device", "max_memory_allocated", "get_device_name",
                 "synchronize", "device_count"):
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "cpu", "--use_cpu",
                               "--total_train_steps", "3", "--mbs", "2", "--seq_len", "32",
                               "--dataset_name", "synthetic", "--set", "logging.log_frequency=1"])
    train.main(["--config", path])
    out = capsys.readouterr().out
    # per-process words, no MFU (a CPU has no peak rate), the grammar of one
    assert "step     3" in out and "tok/s/process" in out and "MFU" not in out
    assert "tok/s/gpu" not in out and "on 1 CPU process (cpu, " in out
    assert ("CPU thread each" in out) == (torch.get_num_threads() == 1)
    assert "(this rank logs:" in out
    records = [json.loads(line) for line in open(tmp_path / "cpu" / "metrics.jsonl")]
    assert len(records) == 3


def test_a_crash_still_logs_every_finished_step(tmp_path, monkeypatch):
    """train.py logs a step once the next one is queued (StepValues); a step that fails (here
    the 4th, as an out-of-memory would) must not take the 3rd step's record with it."""
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "crash", "--use_cpu",
                               "--total_train_steps", "6", "--mbs", "2", "--seq_len", "32",
                               "--dataset_name", "synthetic"])
    real = train.train_step

    def fails_at_the_fourth_step(*args):
        if args[4] == 3:                     # (model, loss_fn, grads, batches, step, ...)
            raise RuntimeError("out of memory (simulated)")
        return real(*args)
    monkeypatch.setattr(train, "train_step", fails_at_the_fourth_step)
    with pytest.raises(RuntimeError, match="simulated"):
        train.main(["--config", path])
    records = [json.loads(line) for line in open(tmp_path / "crash" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
