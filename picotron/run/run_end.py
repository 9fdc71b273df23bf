"""How a run ends: the summary line of what it did and where its outputs are, a stop's one
line and status, and an error said once, not once per rank (`run_and_end` maps each failure
a run may meet to its ending).
"""
import math
import os
import signal
import sys
import time

from picotron.checkpoint.checkpoint import CheckpointError, SharedCheckpointError
from picotron.config import ConfigError, MissingPackage
from picotron.data.windows import DataError
from picotron.errors import RunStopped, SharedDataError
from picotron.run.launcher import tell_launcher
from picotron.run.metrics_log import saturated_steps
from picotron.run.stop_signals import EXIT_STATUS, NAMES
from picotron.run.watchdog import end_if_known_failure
from picotron.utils import duration, plural


def summary(log, started: float, start_step: int, total_steps: int, val, checkpoint,
            metrics_path: str, left_out=None, stopped: bool = False) -> str:
    """The run's last line: steps, time, tokens, final losses, where its outputs are.
    `log` is the run's StepLog (its last record and token count), `started` the host clock
    when the loop began, `val` the last validation's metrics record or None, `checkpoint`
    the last saved directory or None, `left_out` why the last save was left out, or None;
    `stopped`: a stop cut the run short (it opens with "stopped", not "done", which reads as
    a finished run)."""
    took = time.perf_counter() - started
    steps = total_steps - start_step
    tokens = log.tokens_seen - log.tokens_at_start
    last = log.last_record or {}
    ended = "stopped" if stopped else "done"
    parts = [f"{ended}: {steps} steps ({start_step} -> {total_steps}) in {duration(took)}, "
             f"{tokens:,} tokens ({tokens / max(took, 1e-9):,.0f} tok/s)"]
    if "loss" in last:
        parts.append(f"final loss {last['loss']:.4f}")
    if log.skips.total:
        parts.append(f"{plural(log.skips.total, 'step')} skipped (non-finite gradient)")
    saturated = saturated_steps(metrics_path, start_step)    # delayed FP8's, in metrics.jsonl
    if saturated:
        worst = max(saturated, key=lambda r: r["fp8_worst_ratio"] or math.inf)   # null: NaN
        ratio = worst["fp8_worst_ratio"]
        parts.append(f"FP8 saturated at {plural(len(saturated), 'step')} (worst "
                     f"{'non-finite' if ratio is None else f'{ratio:,.1f}x'} at step "
                     f"{worst['step']}, {worst['fp8_worst_site']})")
    if val is not None:
        parts.append(f"val loss {val['val_loss']:.4f}" + (
            f" ({val['val_bits_per_byte']:.4f} bits per byte)" if "val_bits_per_byte" in val
            else ""))
    why = left_out or "checkpoint.save_final=false and no save_frequency"
    not_final = f" (not step {total_steps}: {left_out})" if left_out else ""
    parts.append(f"checkpoint {checkpoint}{not_final}" if checkpoint else
                 f"no checkpoint ({why})")
    parts.append(f"metrics {metrics_path}")
    return "; ".join(parts)


def end_stopped_run(stop, step: int, saved, is_logger: bool, left_out=None) -> None:
    """The end of a run every rank stopped after step `step` (picotron/run/watchdog.py):
    `stop` is (reason, message); `saved` the last checkpoint this launch saved, or None
    (`left_out`: why the stop's save was left out). A signal: one line and the status of a
    process that signal killed (SIGTERM 143, Ctrl-C 130), as a scheduler expects; a diverged
    loss: an error, status 2."""
    reason, message = stop
    if reason == "diverged":
        raise RunStopped(message)
    signum = signal.Signals[reason]
    if is_logger:
        if saved and saved.endswith(f"step_{step:06d}"):
            kept = f"checkpoint {saved} saved"
        else:
            kept = (f"not saved ({left_out or 'checkpoint.save_on_sigterm=false'}); the last "
                    f"checkpoint: {saved or 'none from this launch'}")
        print(f"stopped by {NAMES[signum]} after step {step}: {kept}; resume with --set "
              f"checkpoint.load_path=latest", flush=True)
    raise SystemExit(EXIT_STATUS[signum])


def exit_interrupted() -> None:
    """Ctrl-C before training began (the watchdog takes the signal over from then on): one
    line from rank 0, status 130, no traceback from any rank."""
    if int(os.environ.get("RANK", 0)) == 0:
        print("interrupted (Ctrl-C) while starting: nothing was trained", file=sys.stderr,
              flush=True)
    sys.exit(130)


def exit_with_error(error: Exception, same_on_every_rank: bool) -> None:
    """Print a refused run's message once and exit with status 2.

    Under torchrun every rank raises; printing on each gives one copy per rank, followed by
    torchrun's own report. Rank 0 prints the message; every failing rank also writes it to
    torchrun's error file (TORCHELASTIC_ERROR_FILE), so the report torchrun prints at the end
    names it as the root cause instead of "To enable traceback...". An error that every rank
    meets alike (a config read from the same file) ends the other ranks quietly with status
    0, so torchrun lists one failure, not one per rank; any other error is theirs to report.
    On several nodes the first rank of every node speaks for its node (LOCAL_RANK 0): a node
    whose ranks all exited 0 would wait in torchrun's exit barrier for the failed node
    (minutes) instead of ending at once."""
    rank = int(os.environ.get("RANK", 0))
    first_on_node = int(os.environ.get("LOCAL_RANK", rank)) == 0    # rank 0 on one node
    message = f"error: {error}" if rank == 0 else f"error (rank {rank}): {error}"
    launched = "TORCHELASTIC_ERROR_FILE" in os.environ
    if first_on_node or not (same_on_every_rank or launched):
        print(message, file=sys.stderr, flush=True)
    if first_on_node or not same_on_every_rank:
        tell_launcher(message)
    if not first_on_node and same_on_every_rank:
        sys.exit(0)
    sys.exit(2)


def run_and_end(main) -> None:
    """Run `main()`; a failure a run may meet ends as said above, anything else raises."""
    try:
        main()
    except (ConfigError, MissingPackage, SharedDataError,
            SharedCheckpointError) as e:                    # alike on every rank
        exit_with_error(e, same_on_every_rank=True)
    except (DataError, CheckpointError, RunStopped) as e:
        exit_with_error(e, same_on_every_rank=False)
    except KeyboardInterrupt:            # Ctrl-C before the watchdog took the signal over
        exit_interrupted()
    except BaseException as e:
        end_if_known_failure(e)          # a peer gone, the GPU's memory full: one line
        raise
