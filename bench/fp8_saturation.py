"""How far delayed FP8 scales fall behind their tensors (picotron/speed/fp8/saturation.py): the
ratio seen/A of every site at every step of healthy runs, and what a planted fault does with
and without the guard. Tiny CPU runs on the embedded corpus through train.py's build and step,
fp32, training.fp8 set after loading (the config refuses FP8 on CPU; the math is the GPU's):

    python bench/fp8_saturation.py healthy [--steps 150]
    python bench/fp8_saturation.py fault [--site layers.0.self_attn.o_proj] [--at 20]

healthy: four shapes (tokens a step, width, layers, accumulation), learning rate 1e-3; per
operand (x, dy), the largest ratio, its 99th and 90th percentiles and the share above 2.
fault: the input of one projection times 1000 at step --at + 1 (once; then three times, two
steps apart), in bf16 (training.fp8=none: the reference), tensorwise (every cast scaled by its
own amax) and tensorwise_delayed with the guard off (--holds 0) and on; per run, the loss at
the fault against the bf16 run with the same fault, the largest departure from it over the
20 steps after (and from a bf16 run without the fault), and the sites the roll counted as
saturated from the fault on.
"""
import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import create_config  # noqa: E402
import train  # noqa: E402
from picotron.data.windows import StepBatches, build_train_val  # noqa: E402
from picotron.speed.fp8 import saturation  # noqa: E402

TINY = ["--mbs", "4", "--seq_len", "64", "--num_hidden_layers", "2",
        "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160"]
SHAPES = {"256 tokens, C 64, 2 layers": TINY,
          "1024 tokens, C 64, 2 layers": ["--mbs", "8", "--seq_len", "128",
                                          "--num_hidden_layers", "2", "--set",
                                          "model.hidden_size=64", "--set",
                                          "model.intermediate_size=160"],
          "4096 tokens, C 128, 4 layers": ["--mbs", "16", "--seq_len", "256",
                                           "--num_hidden_layers", "4", "--set",
                                           "model.hidden_size=128", "--set",
                                           "model.intermediate_size=320"],
          "256 tokens, 4 micro-batches": ["--mbs", "2", "--seq_len", "32", "--grad_acc_steps",
                                          "4"] + TINY[4:]}
FAULT, AFTER = 1000.0, 20


def train_run(recipe, steps, flags, out_dir, site=None, at=(), hold=None, ratios=None):
    """One process, train.py's build and step for `steps` steps of the config `flags` (fp32,
    lr 1e-3, 5 warm-up steps) with training.fp8=`recipe`; `site`'s input (a module name) times
    FAULT at the steps `at` (counted from 0); `hold`: saturation.HOLD_STEPS for the run (0:
    no guard). Returns each step's record as train.py logs it: {"loss", and under delayed
    FP8 "fp8_saturated_sites", "fp8_worst_ratio", "fp8_worst_site"}, from queue_step's
    values. `ratios`: a list that gets each step's {site: seen/A} (delayed FP8, after the
    calibrating step)."""
    flags = flags + ["--set", "training.dtype=float32", "--set", "training.warmup_steps=5",
                     "--set", "training.learning_rate=1e-3", "--total_train_steps", str(steps)]
    name = f"{recipe}-{len(os.listdir(out_dir))}"
    path = create_config.main(["--out_dir", out_dir, "--exp_name", name, "--use_cpu"] + flags)
    config, pgm, device = train.setup(path)
    config.training.fp8 = recipe
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    batches = StepBatches(build_train_val(config, out_dir)[0], config, pgm, device)
    now = {"step": -1}
    if site is not None and site in dict(model.named_modules()):   # on this pipeline stage
        model.get_submodule(site).register_forward_pre_hook(
            lambda module, args: (args[0] * FAULT, *args[1:]) if now["step"] in at else None)
    ledger = getattr(model, "fp8_ledger", None)
    saved = saturation.HOLD_STEPS
    saturation.HOLD_STEPS = saved if hold is None else hold
    try:
        out = []
        for step in range(steps):
            now["step"] = step
            r = train.queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm,
                                 device).read()
            out.append({"loss": r["loss"]})
            if ratios is not None and ledger is not None and step > 0:  # step 1 calibrates
                ratios.append(dict(zip(ledger.names, ledger.guard.ratio.tolist())))
            if "fp8_sites" in r:
                out[-1].update(fp8_saturated_sites=int(r["fp8_saturated_sites"]),
                               fp8_worst_ratio=r["fp8_worst_ratio"],
                               fp8_worst_site=r["fp8_sites"][int(r["fp8_worst_site"])])
        return out
    finally:
        saturation.HOLD_STEPS = saved


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def healthy(steps, out_dir):
    for shape, flags in SHAPES.items():
        ratios = []
        train_run("tensorwise_delayed", steps, flags, out_dir, ratios=ratios)
        for operand in ("x", "dy"):
            r = [v for step in ratios for s, v in step.items() if s.endswith("." + operand)]
            print(f"{shape}, {operand}: max {max(r):.2f}, p99 {percentile(r, 99):.2f}, p90 "
                  f"{percentile(r, 90):.2f}, above 2: {sum(v > 2 for v in r) / len(r):.1%} "
                  f"({len(r)} site-steps)", flush=True)


def fault(site, at, holds, out_dir):
    steps = at + AFTER + 1
    clean = [r["loss"] for r in train_run("none", steps, TINY, out_dir)]      # no fault at all
    for pattern, when in (("once", (at,)), ("three times", (at, at + 2, at + 4))):
        reference = [r["loss"] for r in train_run("none", steps, TINY, out_dir, site, when)]
        runs = {"bf16": ("none", None), "tensorwise": ("tensorwise", None)}
        runs.update({f"delayed, hold {h}" + (" (no guard)" if h == 0 else ""):
                     ("tensorwise_delayed", h) for h in holds})
        for name, (recipe, hold) in runs.items():
            records = train_run(recipe, steps, TINY, out_dir, site, when, hold)
            departure = [abs(r["loss"] / want - 1) for r, want in zip(records, reference)]
            unfaulted = [abs(r["loss"] / want - 1) for r, want in zip(records, clean)]
            print(f"{site} x{FAULT:g} {pattern} at step {at + 1}, {name}: at the fault "
                  f"{records[at]['loss'] / reference[at] - 1:+.2%} from bf16's, then at most "
                  f"{max(departure[at + 1:]):.2%} (from the run without the fault: "
                  f"{max(unfaulted[at + 1:]):.2%}); saturated site-steps "
                  f"{sum(r.get('fp8_saturated_sites', 0) for r in records[at:])}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("what", choices=("healthy", "fault"), help="which measurement")
    p.add_argument("--steps", type=int, default=150, help="healthy: steps a run (default: 150)")
    p.add_argument("--site", default="layers.0.self_attn.o_proj",
                   help="fault: the projection whose input spikes (default: "
                        "layers.0.self_attn.o_proj)")
    p.add_argument("--at", type=int, default=20,
                   help="fault: steps before the first spike (default: 20)")
    p.add_argument("--holds", default="0,2,8,16",
                   help="fault: guard lengths (saturation.HOLD_STEPS) to run, comma-separated; 0 "
                        "is no guard (default: 0,2,8,16)")
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out_dir:
        if args.what == "healthy":
            healthy(args.steps, out_dir)
        else:
            fault(args.site, args.at, [int(h) for h in args.holds.split(",")], out_dir)


if __name__ == "__main__":
    main()
