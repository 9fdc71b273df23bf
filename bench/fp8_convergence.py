"""Does FP8 train like bf16? The same run, same seed and data, in bf16 and in each FP8 recipe.

    python bench/fp8_convergence.py [--model_name SmolLM-135M] [--steps 300] [--out DIR]
        [--data FILE --val_every N] [--recipes none,auto]

Trains `--model_name` (default SmolLM-135M) on the embedded corpus (the text of Python's
standard library, byte-level: no download; up to 8 MiB) or, with `--data`, on a local file's
bytes (`dataset.byte_range`: all but its last `--val_samples` windows train, those validate),
seq 2048, micro-batch 16, bf16 with fp32 master weights, the GPU defaults (model.kernels
triton, selective recomputation), once with training.fp8=none and once per recipe ("auto": a
run with no flag), each through torchrun train.py on one GPU. The judge is the loss on
`--val_samples` held-out windows (never trained on) after the last step, and every
`--val_every` steps before it: the same tokens for every run, so the batch-to-batch noise of
the training loss (+-0.1 at step 300) is out of it. Prints each run's final val loss, its gap to bf16's (the bar:
within 1%), the mean of its last 10 training losses and its median tokens/s, and draws the curves
side by side with plot.py into DIR/fp8_convergence.png (needs matplotlib). Every run stays
under DIR/runs.

bf16 is not reproducible to the last bit on a GPU (our kernels' atomic sums), and a few hundred
steps amplify that, so name `none` more than once (`--recipes none,none,tensorwise,tensorwise`):
the bench then prints bf16's own spread, the noise a recipe's gap is to be read against.

Measured: bench/NOTES.md (the PNG beside it).
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import create_config  # noqa: E402

RECIPES = "none,none,tensorwise,rowwise"    # bf16 twice: its own spread is the noise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args, recipe: str, name: str):
    """One run's step records, or a string saying why there are none."""
    # a run of this name from an earlier call of the bench: train.py would not start over it
    shutil.rmtree(os.path.join(args.out, "runs", f"fp8-{name}"), ignore_errors=True)
    path = create_config.main([
        "--out_dir", os.path.join(args.out, "runs"), "--exp_name", f"fp8-{name}",
        "--model_name", args.model_name, "--mbs", str(args.mbs),
        "--seq_len", str(args.seq), "--total_train_steps", str(args.steps),
        "--learning_rate", str(args.learning_rate), "--set", "dataset.tokenizer=byte",
        "--set", "training.dtype=bfloat16", "--set", "training.master_weights=true",
        "--set", f"training.fp8={recipe}", "--set", "checkpoint.save_final=false",
        "--set", f"dataset.val_samples={args.val_samples}", *data_flags(args),
        "--set", f"training.val_frequency={args.val_every or args.steps}",
        *(["--use_cpu"] if args.cpu else [])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(free_port()), os.path.join(ROOT, "train.py"), "--config", path]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"FAILED rc={proc.returncode}: {proc.stderr.strip()[-600:]}"
    with open(os.path.join(os.path.dirname(path), "metrics.jsonl")) as f:
        records = list(map(json.loads, f))
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    return [r for r in records if "loss" in r], val


def data_flags(args) -> list:
    """The embedded corpus, or `--data`'s bytes: the last val_samples windows held out."""
    if not args.data:
        return ["--dataset_name", "embedded"]
    size, window = os.path.getsize(args.data), args.seq + 1
    held_out = args.val_samples * window
    return ["--dataset_name", os.path.abspath(args.data),
            "--set", f"dataset.byte_range=[0,{size - held_out}]",
            "--set", f"dataset.val_byte_range=[{size - held_out},{size}]"]


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name", default="SmolLM-135M", help="preset (%(default)s)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (%(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (%(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (%(default)s)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="peak (%(default)s)")
    p.add_argument("--val_samples", type=int, default=64, help="held-out windows of seq + 1 "
                   "bytes the runs are judged on (%(default)s)")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder of the runs and the PNG (default: $OUT, else here)")
    p.add_argument("--recipes", default=RECIPES, help="training.fp8 values, comma-separated, "
                   "none (bf16, the reference) first; a value named twice runs twice, e.g. "
                   "none,none,none,tensorwise for bf16's own spread (default: %(default)s)")
    p.add_argument("--cpu", action="store_true", help="a dry run on CPU (bf16 only: FP8 needs "
                   "a GPU), to check the bench itself")
    p.add_argument("--data", help="a local file whose bytes train and validate, instead of the "
                   "embedded corpus")
    p.add_argument("--val_every", type=int, default=0, help="held-out loss every N steps too "
                   "(default: after the last step only)")
    args = p.parse_args()
    runs, finals, curves, bf16 = {}, {}, {}, []
    recipes = args.recipes.split(",")
    for k, recipe in enumerate(recipes):
        # a recipe named twice runs twice: bf16 repeated measures the bench's own noise (our
        # kernels' atomic sums make two runs of one seed differ in the last bits, and 300
        # steps amplify that)
        name = recipe if recipes.index(recipe) == k else f"{recipe}-{recipes[:k].count(recipe)}"
        result = train(args, recipe, name)
        if isinstance(result, str):
            print(f"fp8={name:12s} {result}", flush=True)
            continue
        steps, vals = result
        finals[name], runs[name], curves[name] = vals.get(args.steps, float("nan")), steps, vals
        if recipe == "none":
            bf16.append(finals[name])
        gap = (f" ({finals[name] / statistics.mean(bf16) - 1:+.2%} from bf16's mean)"
               if bf16 and recipe != "none" else "")
        train_loss = statistics.mean(r["loss"] for r in steps[-10:])
        tps = statistics.median(r["tokens_per_s"] for r in steps[5:] or steps)
        print(f"fp8={name:12s} {len(steps)} steps, val loss {finals[name]:.4f}{gap}, last 10 "
              f"train losses {train_loss:.4f}, {tps:,.0f} tok/s", flush=True)
    if bf16 and len(curves) > 1:     # each held-out point: every run's loss, / bf16's first
        points = sorted(set.intersection(*(set(v) for v in curves.values())))
        base = next(n for n in runs if n.split("-")[0] == "none")
        for step in points:
            print(f"held-out at step {step}: " + ", ".join(
                f"{n} {v[step]:.4f} ({v[step] / curves[base][step]:.4f}x)"
                for n, v in curves.items()), flush=True)
    if len(bf16) > 1:
        print(f"bf16 alone: {len(bf16)} runs, val losses {min(bf16):.4f}..{max(bf16):.4f}, "
              f"spread {(max(bf16) - min(bf16)) / statistics.mean(bf16):.2%} of their mean",
              flush=True)
    if runs:
        import plot
        png = os.path.join(args.out, "fp8_convergence.png")
        try:
            plot.plot([os.path.join(args.out, "runs", f"fp8-{r}") for r in runs], png)
            print(f"curves: {png}")
        except plot.PlotError as e:
            print(f"no plot: {e}")


if __name__ == "__main__":
    main()
