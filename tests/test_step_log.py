"""picotron/run/step_log.py: one record per step, logged one step behind, each step timed by its own
start and end marks (never by the host's time between two log calls).

The fake steps below make no model: a step is `start()`, a small op on the device, WORK_S of
host time, `queued()`. On CPU the step is timed by the host clock; on a GPU (when present) by
CUDA events, where the host's WORK_S leaves the GPU idle inside the step and so is counted too.
"""
import json
import time

import pytest
import torch

from picotron.config import Config
from picotron.run.step_log import StepLog
from picotron.run.metrics_log import MetricsLog
from picotron.utils import StepValues

WORK_S = 0.05          # one step's work
CHECKPOINT_S = 0.5     # host time between a flush and the next step: never counted
TOKENS_PER_STEP = 2 * 3 * 16      # micro batch x gradient accumulation x sequence length
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def make_log(tmp_path, device="cpu", tokens_seen=0, is_logger=True, **training):
    config = Config()
    t = config.training
    t.micro_batch_size, t.gradient_accumulation_steps, t.seq_length = 2, 3, 16
    for name, value in training.items():
        setattr(t, name, value)
    if device == "cuda":
        torch.zeros(1, device=device)           # start CUDA outside the timed steps
    metrics = MetricsLog(str(tmp_path / "metrics.jsonl"), is_logger, config)
    return StepLog(metrics, config, torch.device(device), tokens_seen=tokens_seen,
                   is_logger=is_logger)


def step(log, i, device="cpu", work_s=0.0):
    """Step i (from 0): its loss is 2 + i, so a record shows which step it came from."""
    log.start(i)
    loss = torch.full((), 2.0 + i, device=device)
    time.sleep(work_s)
    log.queued(StepValues({"lr": 1e-3, "loss": loss, "grad_norm": loss / 2,
                           "skipped": torch.zeros((), device=device), "loss_scale": 8.0},
                          torch.device(device)))


def records(tmp_path):
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("device", DEVICES)
def test_every_step_time_covers_one_step(tmp_path, device):
    log = make_log(tmp_path, device)
    for i in range(6):
        step(log, i, device, WORK_S)
        if i == 1:       # flushed right after it was queued, then a checkpoint
            log.flush()
            time.sleep(CHECKPOINT_S)
        if i in (2, 5):  # step 2: flushed right after another flush; step 5: the last step
            log.flush()
    times = {r["step"]: r["step_time_s"] for r in records(tmp_path)}
    assert sorted(times) == [1, 2, 3, 4, 5, 6]
    # The host time between two log calls would give steps 2 and 6 (flushed at once after
    # the step before was logged) a few microseconds; counting the checkpoint would give
    # step 3 over CHECKPOINT_S.
    assert all(WORK_S * 0.95 <= s < CHECKPOINT_S for s in times.values()), times
    for r in records(tmp_path):      # the throughput follows from the same step time
        assert r["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP / r["step_time_s"])


def test_tokens_advance_by_one_step_per_record(tmp_path):
    log = make_log(tmp_path, tokens_seen=1000)
    for i in range(4):
        step(log, i)
        if i == 1:
            log.flush()      # a checkpoint here saves the tokens of steps 1 and 2
            assert log.tokens_seen == 1000 + 2 * TOKENS_PER_STEP
    log.flush()
    assert log.tokens_seen == 1000 + 4 * TOKENS_PER_STEP
    assert [r["tokens"] for r in records(tmp_path)] == [
        1000 + k * TOKENS_PER_STEP for k in range(1, 5)]


def test_one_record_per_step_in_order(tmp_path):
    log = make_log(tmp_path)
    log.flush()                              # nothing pending: nothing happens
    for i in range(7):
        step(log, i)
        if i in (0, 3, 4):
            log.flush()
            log.flush()                      # a second flush finds nothing to log
    assert len(records(tmp_path)) == 6       # step 7 is still pending: logged one step behind
    log.flush()
    log.flush()
    got = records(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["loss"] for r in got] == [2.0 + i for i in range(7)]
    assert [r["grad_norm"] for r in got] == [(2.0 + i) / 2 for i in range(7)]
    assert set(got[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
                           "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gb",
                           "step_time_s", "skipped", "total_steps", "elapsed_s", "eta_s"}
    assert got[0]["eta_s"] is None and got[-1]["eta_s"] >= 0     # left: from step 2 on
    assert got[0]["total_steps"] == 200 and got[-1]["elapsed_s"] >= got[0]["elapsed_s"]
    assert got[0]["mfu"] is None and got[0]["skipped"] is False      # CPU: no peak FLOP/s


def test_prints_every_log_frequency_steps_on_the_logger_only(tmp_path, capsys):
    log = make_log(tmp_path, dtype="float16")
    log.config.logging.log_frequency = 2
    for i in range(5):
        step(log, i)
    log.flush()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].split() for line in lines] == [["step", "2/200"],
                                                               ["step", "4/200"]]
    assert all(r["loss_scale"] == 8.0 for r in records(tmp_path))    # fp16 only
    quiet = make_log(tmp_path / "other", is_logger=False)
    for i in range(3):
        step(quiet, i)
    quiet.flush()
    assert capsys.readouterr().out == "" and not (tmp_path / "other").exists()
    assert quiet.tokens_seen == 3 * TOKENS_PER_STEP     # every rank still counts
