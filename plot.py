"""Plot one or more runs: `python plot.py RUN_DIR [RUN_DIR ...] [--out FILE.png]`.

Reads each run's `metrics.jsonl` (train.py writes one record per step, and `{step, val_loss}`
records when `training.val_frequency` is set) and draws one PNG of three panels, every run
in its own colour with its name in the legend:
- loss against tokens seen: the training loss as a line, the validation loss as dots on a
  dashed line (tokens, not steps, so runs with different global batches line up);
- tokens/s against step (the whole run's throughput, all GPUs);
- MFU against step (empty for runs on CPU, which report none).

    python plot.py tmp/debug                                # -> metrics.png
    python plot.py tmp/dp2 tmp/tp2 --out compare.png --size 1800x500

Needs matplotlib (`pip install matplotlib`); it is optional for training.
"""
import argparse
import json
import math
import os
import sys


STEP_KEYS = ("step", "loss", "tokens", "tokens_per_s")      # what each step record must hold


class PlotError(ValueError):
    """A run directory or option that cannot be plotted; the message names the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", type=os.path.expanduser, nargs="+", metavar="RUN_DIR",
                   help="a run directory (the folder holding config.json and metrics.jsonl), "
                        "or a metrics.jsonl file; several are drawn side by side")
    p.add_argument("--out", type=os.path.expanduser, default="metrics.png",
                   help="the image to write: a PNG, or another format its extension names "
                        "(.pdf, .svg); default: metrics.png in the current folder")
    p.add_argument("--size", default="1500x450", metavar="WIDTHxHEIGHT",
                   help="image size in pixels (default: 1500x450)")
    return p


def text_lines(path: str) -> list:
    """(line number, line) of each line of `path` that is not blank. train.py writes ASCII
    JSON, so bytes that are not UTF-8 mean another kind of file (an image, an archive)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise PlotError(f"{path} is not text ({e.reason}: its bytes are not UTF-8), so not "
                        f"a metrics.jsonl written by train.py; give a run directory or its "
                        f"metrics.jsonl") from None


def read_metrics(run: str) -> tuple:
    """(step records, validation records) of a run directory or a metrics.jsonl file. Non-finite
    values are null in the file (picotron.run.metrics_log.MetricsLog): read as NaN. A last line that
    is not whole JSON (a run killed while writing it, or still writing) is dropped with a warning,
    as train.py's resume drops it (picotron.run.metrics_log.read_records)."""
    path = run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        what = "is not a directory" if not os.path.isdir(run) else "has no metrics.jsonl"
        raise PlotError(f"'{run}' {what}; pass a run directory that train.py has logged at "
                        f"least one step to (the folder of its config.json, or "
                        f"logging.run_dir)")
    steps, vals = [], []
    lines = text_lines(path)
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == lines[-1][0]:        # a run killed (or still) writing it: half a line
                print(f"warning: {path}:{n}: dropped the last line, which is not whole JSON "
                      f"(a run killed while writing it, or still writing)", file=sys.stderr)
                break
            raise PlotError(f"{path}:{n} is not JSON ({e}); is it a metrics.jsonl "
                            f"written by train.py?") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path}:{n} is a JSON {type(record).__name__}, not the "
                            f"object train.py writes; is it a metrics.jsonl?")
        if "step" not in record:
            raise PlotError(f"{path}:{n}: a record without \"step\", which train.py writes "
                            f"in every record; is it a metrics.jsonl written by train.py?")
        record = {k: math.nan if v is None else v for k, v in record.items()}
        bad = [k for k in (*STEP_KEYS, "val_loss", "mfu") if k in record and (
            isinstance(record[k], bool) or not isinstance(record[k], (int, float)))]
        if bad:
            raise PlotError(f"{path}:{n}: {', '.join(bad)} must be numbers, got "
                            f"{', '.join(repr(record[k]) for k in bad)}; is it a "
                            f"metrics.jsonl written by train.py?")
        if "val_loss" in record:
            vals.append(record)
        elif "loss" in record:
            steps.append(record)
    if not steps:
        raise PlotError(f"{path} holds no training step yet; plot it once a step is logged")
    missing = sorted({k for r in steps for k in STEP_KEYS if k not in r})
    if missing:
        raise PlotError(f"{path}: step records without {', '.join(missing)}; is it a "
                        f"metrics.jsonl written by train.py?")
    return steps, vals


def tokens_at(steps: list):
    """A function: step -> tokens seen after it. A validation step without its step record
    (a run cut short) gets the step's tokens at the run's tokens per step."""
    seen = {r["step"]: r["tokens"] for r in steps}
    per_step = steps[-1]["tokens"] / max(steps[-1]["step"], 1)

    def tokens(step: int) -> float:
        return seen.get(step, step * per_step)
    return tokens


def parse_size(text: str) -> tuple:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        width = height = 0
    if width < 100 or height < 100:
        raise PlotError(f"--size {text!r} must be WIDTHxHEIGHT in pixels, each at least 100, "
                        f"e.g. --size 1500x450")
    return width, height


def labels_of(runs: list) -> list:
    """Each run's folder name, or the path as given when two folders share a name."""
    names = [os.path.basename(os.path.normpath(r if os.path.isdir(r) else os.path.dirname(r)
                                               or ".")) for r in runs]
    return [n if names.count(n) == 1 else r for n, r in zip(names, runs)]


def plot(runs: list, out: str, size=(1500, 450)) -> str:
    """Draw `runs` (run directories or metrics.jsonl files) into the image `out` (a PNG
    unless its extension names another format matplotlib writes); returns its path."""
    data = [read_metrics(r) for r in runs]          # every run checked before drawing
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plot.py needs matplotlib: `pip install matplotlib`") from None
    matplotlib.use("Agg")                           # files only: no display needed
    import matplotlib.pyplot as plt

    if os.path.isdir(out) or out.endswith(os.sep):
        raise PlotError(f"--out {out!r} is a folder; give a file name, e.g. "
                        f"{os.path.join(out, 'metrics.png')}")
    ext = os.path.splitext(out)[1][1:].lower()
    if not ext:                     # matplotlib would add ".png": say the path it writes
        out, ext = out + ".png", "png"
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if ext not in formats:
        raise PlotError(f"--out {out!r}: matplotlib cannot write '.{ext}' files; use one of "
                        f"{', '.join('.' + f for f in sorted(formats))} (e.g. .png)")

    dpi = 100
    fig, (loss_ax, speed_ax, mfu_ax) = plt.subplots(1, 3, figsize=(size[0] / dpi,
                                                                    size[1] / dpi), dpi=dpi)
    measured_mfu = False
    for i, ((steps, vals), label) in enumerate(zip(data, labels_of(runs))):
        colour = f"C{i}"
        step_numbers = [r["step"] for r in steps]
        loss_ax.plot([r["tokens"] for r in steps], [r["loss"] for r in steps], color=colour,
                     label=f"{label} train")
        if vals:
            tokens = tokens_at(steps)
            loss_ax.plot([tokens(r["step"]) for r in vals], [r["val_loss"] for r in vals],
                         "o--", color=colour, label=f"{label} validation")
        speed_ax.plot(step_numbers, [r["tokens_per_s"] for r in steps], color=colour,
                      label=label)
        mfu = [100 * r.get("mfu", math.nan) for r in steps]   # NaN (CPU: none) draws nothing
        mfu_ax.plot(step_numbers, mfu, color=colour, label=label)
        measured_mfu = measured_mfu or any(math.isfinite(v) for v in mfu)
    if not measured_mfu:
        mfu_ax.text(0.5, 0.5, "no MFU: runs on CPU report none", ha="center",
                    transform=mfu_ax.transAxes)
        mfu_ax.set_xticks([])
        mfu_ax.set_yticks([])
    for ax, title, xlabel, ylabel in (
            (loss_ax, "loss", "tokens seen", "loss"),
            (speed_ax, "throughput", "step", "tokens/s (all GPUs)"),
            (mfu_ax, "model FLOPs utilization", "step", "MFU (%)")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=dpi)
    except OSError as e:
        raise PlotError(f"cannot write --out {out!r} ({type(e).__name__}: {e}); choose a "
                        f"path in a folder you can write") from None
    finally:
        plt.close(fig)
    return out


def main(argv=None) -> str:
    args = build_parser().parse_args(argv)
    try:
        path = plot(args.runs, args.out, parse_size(args.size))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(path)
    return path


if __name__ == "__main__":
    main()
