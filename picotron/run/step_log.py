"""One record per optimizer step (loss, throughput, MFU, memory), logged one step behind.

The loop queues step k+1 on the GPU before it reads step k's loss and grad norm
(picotron.utils.StepValues): reading a value makes the host wait for the step that
produced it, and waiting right after queueing would leave the GPU idle while the host queues
the next step's first kernels. So a step is logged once the next one is queued, or at once by
`flush()` where the loop must stop anyway (validation, a checkpoint, the last step, a crash).

Why each step is timed by its own two marks: the host clock between two logging calls is not
a step's time. A step flushed right after it was queued is logged moments after the step
before it, so its "step time" is a fraction of a millisecond and its MFU absurd (over 100%);
a step logged after a checkpoint would count the checkpoint. Instead `start()` and
`queued()` mark the two ends of each step:

- on CUDA, two timing events on the current stream. The GPU stamps an event when it reaches
  it in the stream, so the time between them is the step on the GPU's timeline: all of its
  kernels, plus any idle gap the host causes inside the step (a slow data loader shows up),
  but never validation or a checkpoint between steps, which run before `start()` is recorded.
  Reading them does not wait: by the time a step is logged, `values.read()` has waited for
  its values, which come after its end event in the stream.
- on CPU, the host's clock: every op runs synchronously inside the step's queueing, so the
  time between the two marks is the step's work.
"""
import math
import resource
import time

import torch

from picotron.run.divergence import DivergenceCheck
from picotron.run.skipped_steps import SkippedSteps
from picotron.utils import flops_per_token, format_step, peak_flops


def peak_memory_gb(device) -> float:
    """The most memory this process has held: the CUDA allocator's peak reservation, or on CPU
    the process's peak resident set. Reserved, not allocated: a CUDA graph's pool counts as
    allocated only while it is captured, though the graph holds it from then on."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB -> GiB


class StepLog:
    """Logs each step one step behind: `start(step)`, queue the step, `queued(values)`.

        log = StepLog(metrics, config, device, tokens_seen=start_tokens, is_logger=is_logger)
        for step in range(start, total):
            log.start(step)
            log.queued(queue_step(...))     # logs the step before this one, if any
            if validate or save or last:
                log.flush()                 # logs this step now; tokens_seen is up to date

    Every rank reads its values (so all ranks stay in step), `metrics` writes on the logging
    rank only, and the logging rank prints every `logging.log_frequency` steps."""

    def __init__(self, metrics, config, device, tokens_seen: int = 0, is_logger: bool = True,
                 save_dir=None, on_diverged=None):
        self.metrics, self.config, self.device = metrics, config, device
        # a diverged loss: on_diverged("diverged", message) asks every rank to stop
        self.divergence, self.on_diverged = DivergenceCheck(config.training, save_dir), on_diverged
        self.tokens_seen = tokens_seen          # tokens of all logged steps
        self.is_logger = is_logger
        self.tokens_per_step = config.global_batch_size * config.training.seq_length
        self.flops_per_token = flops_per_token(config.model, config.training.seq_length)
        self.peak = peak_flops(device)          # None on CPU: no MFU
        self.started = None     # (step, start mark) of the step being queued
        self.pending = None     # (step, values, start mark, end mark): queued, not yet logged
        # progress: host-clock start of this launch, and the first logged step's end (the
        # time left is extrapolated from the steps after it: the first pays the warm-up)
        self.tokens_at_start = tokens_seen
        self.clock_start, self.first_logged = time.perf_counter(), None
        self.last_record = None
        self.skips = SkippedSteps(config.training, save_dir)   # their streak, and its rules

    def _mark(self):
        """A point in time: a CUDA event on the current stream, or the host's clock."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _seconds(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()        # done already (values.read() waited); cheap to be sure
            return start.elapsed_time(end) / 1000      # ms -> s
        return end - start

    def start(self, step: int) -> None:
        """Before step `step` (counted from 0) is queued: marks its start."""
        self.started = (step, self._mark())

    def queued(self, values) -> None:
        """After the step is queued, with its StepValues: marks its end, then logs the step
        before it (which has finished, or is about to: reading it waits for that step only)."""
        assert self.started is not None, "StepLog.queued() without start()"
        (step, start), self.started = self.started, None
        previous, self.pending = self.pending, (step, values, start, self._mark())
        if previous is not None:
            self._log(*previous)

    def flush(self) -> None:
        """Waits for the pending step, if any, and logs it now."""
        if self.pending is not None:
            pending, self.pending = self.pending, None   # never logged twice, even on error
            self._log(*pending)

    def _log(self, step, values, start, end) -> None:
        r = values.read()                                 # waits for this step only
        step_time = self._seconds(start, end)
        self.tokens_seen += self.tokens_per_step
        per_gpu = self.tokens_per_step / step_time / self.config.world_size
        record = {"step": step + 1, "loss": r["loss"], "lr": r["lr"],   # steps done, from 1
                  "grad_norm": r["grad_norm"], "tokens": self.tokens_seen,
                  "tokens_per_s": self.tokens_per_step / step_time,
                  "tokens_per_s_per_gpu": per_gpu,
                  "tflops_per_gpu": per_gpu * self.flops_per_token / 1e12,
                  "mfu": per_gpu * self.flops_per_token / self.peak if self.peak else None,
                  "peak_mem_gb": peak_memory_gb(self.device), "step_time_s": step_time,
                  "skipped": bool(r["skipped"])}   # a non-finite gradient norm: no update
        if self.config.training.dtype == "float16":
            record["loss_scale"] = r["loss_scale"]
        if "fp8_worst_ratio" in r:   # delayed FP8: the sites whose tensors outgrew their scales
            sites = record["fp8_saturated_sites"] = int(r["fp8_saturated_sites"])
            record["fp8_worst_ratio"] = r["fp8_worst_ratio"]
            if sites:
                record["fp8_worst_site"] = r["fp8_sites"][int(r["fp8_worst_site"])]
            before = self.last_record or {}
            if (not math.isfinite(r["loss"]) and math.isfinite(before.get("loss", math.nan))
                    and "fp8_saturated_sites" in before):
                # the first non-finite loss: what the step before it saturated
                record["fp8_saturated_before"] = {k: before[k] for k in (
                    "step", "fp8_saturated_sites", "fp8_worst_ratio", "fp8_worst_site")
                    if k in before}
        record.update(self._progress(step + 1))
        self.metrics.write(record)
        self.last_record = record
        if self.is_logger and record["step"] % self.config.logging.log_frequency == 0:
            print(format_step(record, on_cpu=self.device.type == "cpu"), flush=True)
        self.skips.update(record["step"], record["skipped"], record["loss"], record["grad_norm"],
                          self.device)
        diverged = self.divergence.update(record["step"], record["loss"])
        if diverged and self.on_diverged is not None:
            self.on_diverged("diverged", diverged)

    def _progress(self, done: int) -> dict:
        """Elapsed time of this launch and the time left, from the mean step since the first
        logged one (host clock: the wall time a user waits, checkpoints and validation
        included)."""
        now, total = time.perf_counter(), self.config.training.total_train_steps
        if self.first_logged is None:
            self.first_logged = (done, now)
        first_step, first_time = self.first_logged
        left = None
        if done > first_step:
            left = (now - first_time) / (done - first_step) * (total - done)
        return {"total_steps": total, "elapsed_s": now - self.clock_start, "eta_s": left}
