"""Plot one or more runs: `python plot.py RUN_DIR [RUN_DIR ...] [--out FILE.png]`.

Reads each run's `metrics.jsonl` (train.py writes one record per step, and `{step, val_loss}`
records when `training.val_frequency` is set) and draws one PNG of up to three panels, every
run in its own colour with its name in the legend:
- loss against tokens seen: the training loss as a line, the validation loss as dots on a
  dashed line (tokens, not steps, so runs with different global batches line up);
- tokens/s against step (the whole run's throughput: all its GPUs, or all its processes on
  CPU);
- MFU against step, drawn only when some run reports one (on CPU there is none).

One run's picture goes beside it, several runs' into the current folder; `--out` names
another file. The path written is printed.

    python plot.py tmp/debug                                # -> tmp/debug/metrics.png
    python plot.py tmp/dp2 tmp/tp2                          # -> metrics.png
    python plot.py tmp/dp2 tmp/tp2 --out compare.png --size 1800x500

Needs matplotlib (`pip install matplotlib`); it is optional for training.
"""
import argparse
import json
import math
import os
import sys

from picotron.config.overrides import parse_flags

STEP_KEYS = ("step", "loss", "tokens", "tokens_per_s")      # what each step record must hold


class PlotError(ValueError):
    """A run directory or option that cannot be plotted; the message names the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", type=os.path.expanduser, nargs="+", metavar="RUN_DIR",
                   help="a run directory (the folder holding config.json and metrics.jsonl), "
                        "or a metrics.jsonl file; several are drawn side by side")
    p.add_argument("--out", type=os.path.expanduser,
                   help="the image to write: a PNG, or another format its extension names "
                        "(.pdf, .svg); default: metrics.png beside the run when one is "
                        "plotted (RUN_DIR/metrics.png), in the current folder for several")
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


def default_out(runs: list) -> str:
    """Where the picture goes without --out: beside the run when one is plotted (in its folder,
    or beside its metrics.jsonl), else in the current folder, as no run's folder is theirs."""
    if len(runs) != 1:
        return "metrics.png"
    run = runs[0]
    return os.path.join(run if os.path.isdir(run) else os.path.dirname(run), "metrics.png")


def panels(data: list, labels: list) -> list:
    """(title, x label, y label, lines) of each panel some run has a number for, a line being
    (xs, ys, format, colour, label). Only runs on GPUs report an MFU: runs on CPU get no MFU
    panel, and their throughput is that of all their processes."""
    loss, speed, mfu = [], [], []
    for i, ((steps, vals), label) in enumerate(zip(data, labels)):
        colour, step_numbers = f"C{i}", [r["step"] for r in steps]
        loss.append(([r["tokens"] for r in steps], [r["loss"] for r in steps], "-", colour,
                     f"{label} train"))
        if vals:
            tokens = tokens_at(steps)
            loss.append(([tokens(r["step"]) for r in vals], [r["val_loss"] for r in vals],
                         "o--", colour, f"{label} validation"))
        speed.append((step_numbers, [r["tokens_per_s"] for r in steps], "-", colour, label))
        mfu.append((step_numbers, [100 * r.get("mfu", math.nan) for r in steps], "-", colour,
                    label))                      # NaN (null: none measured) draws nothing
    on_gpus = all(any(math.isfinite(v) for v in ys) for _, ys, *_ in mfu)
    every = [("loss", "tokens seen", "loss", loss),
             ("throughput", "step", f"tokens/s (all {'GPUs' if on_gpus else 'processes'})",
              speed),
             ("model FLOPs utilization", "step", "MFU (%)", mfu)]
    return [p for p in every if any(math.isfinite(v) for _, ys, *_ in p[3] for v in ys)]


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

    drawn = panels(data, labels_of(runs))
    if not drawn:
        raise PlotError(f"nothing to draw: every loss and tokens/s of {', '.join(runs)} is "
                        f"null")
    dpi = 100
    fig, axes = plt.subplots(1, len(drawn), figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi,
                             squeeze=False)
    for ax, (title, xlabel, ylabel, lines) in zip(axes[0], drawn):
        for xs, ys, fmt, colour, label in lines:
            ax.plot(xs, ys, fmt, color=colour, label=label)
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
    args = parse_flags(build_parser(), argv)
    try:
        path = plot(args.runs, args.out or default_out(args.runs), parse_size(args.size))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(path)
    return path


if __name__ == "__main__":
    main()
