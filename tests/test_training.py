"""Single-process training on CPU: it learns, it logs the metrics the README lists, and a CPU run
never touches CUDA."""
import json
import math

import pytest
import torch

import create_config
import train
from launch import launch, read_metrics
from picotron.config import TrainingConfig
from picotron.data import embedded_corpus_bytes
from picotron.utils import lr_at

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
               "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gb", "step_time_s"}


def unigram_entropy(tokens) -> float:
    """Cross-entropy (nats) of the best model that ignores context: the byte frequencies."""
    p = torch.bincount(tokens.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return -(p * p.log()).sum().item()


def test_debug_model_learns_the_embedded_corpus(tmp_path):
    """200 steps of `debug` on the stdlib corpus. Threshold: the mean loss of the last 20 steps
    must be 0.3 nats below the corpus's byte unigram entropy (about 3.3 nats; ln 256 = 5.55 at
    the start). Beating the unigram entropy is only possible by using the context, so this
    cannot pass by learning byte frequencies alone (it ends near 2.6 on this corpus)."""
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "learn", "--use_cpu",
                               "--total_train_steps", "200", "--mbs", "4", "--seq_len", "128",
                               "--learning_rate", "1e-3", "--set", "training.warmup_steps=20"])
    launch(path, 1)
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(1, 201))
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert abs(records[0]["loss"] - math.log(256)) < 0.2        # uniform-ish start
    threshold = unigram_entropy(embedded_corpus_bytes()) - 0.3
    final = sum(r["loss"] for r in records[-20:]) / 20
    assert final < threshold, (final, threshold)
    assert records[-1]["tokens"] == 200 * 4 * 128
    assert all(r["mfu"] is None for r in records)                # CPU: no peak rate


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
    assert "step     3" in out and "MFU n/a" in out
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
