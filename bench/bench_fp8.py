"""FP8 training (training.fp8) on one GPU, measured against bf16 in the same call.

    python bench/bench_fp8.py gemms [--shapes SmolLM-360M,SmolLM-1.7B] [--mbs 16] [--seq 2048]
    python bench/bench_fp8.py steps [--shapes SmolLM-360M,SmolLM-1.7B] [--rows LABELS]
e.g. the fused casts against the separate ones at 1.7B, in one call (the --rows value on one line):
    python bench/bench_fp8.py gemms --shapes SmolLM-1.7B
    python bench/bench_fp8.py steps --shapes SmolLM-1.7B --rows "ours defaults,ours fp8
        tensorwise,ours fp8 rowwise,ours fp8 rowwise unfused casts,ours fp8
        rowwise_bf16_dw,ours fp8 rowwise_bf16_dw unfused casts,hf+liger"

gemms: one decoder layer's projections (fused q/k/v, o, fused gate/up, down) at micro-batch x seq
tokens, forward + backward (the three GEMMs each), CUDA events over 20 runs, for each recipe
(tensorwise, rowwise, rowwise_bf16_dw) against bf16 (fused_linear / F.linear, the path
model.kernels=triton runs); then "mlp": gate/up, the SwiGLU and down as one, as "selective" runs it
(fp8_triton.fp8_swiglu_mlp against fused_linear + swiglu_linear), the row where the casts
(row-scaled) or amaxes (tensorwise) fused into the SwiGLU kernels (picotron/speed/fp8/fused.py)
show, and "layer mlp", the layer's total with that row for gate/up and down. Columns (`--variants`
picks some):
- "cached": fp8_linear as training runs it: our cast kernels (picotron/speed/fp8/cast.py), the
  weights' FP8 copies from a warm Fp8WeightCache (every micro-batch but a step's first), and in the
  mlp row the casts (row-scaled) or the amaxes (tensorwise) fused into the SwiGLU kernels;
- "unfused" (mlp row only): "cached" with fp8_fused.FUSED off: the separate cast kernels;
- "per use": our cast kernels, the weights cast at every use (a step's first micro-batch);
- "compiled": the casts as before our kernels: fp8_quantize's reference amax and cast, each
  torch.compile'd, the weights cast at every use;
- "eager": the reference casts op by op;
- "alone": the FP8 GEMMs on operands quantized once outside the timing (the ceiling);
- "host": "cached"'s time on the CPU (Python, autograd, launches) per forward + backward,
  measured without waiting for the GPU (and bf16's beside it): when it exceeds the GPU time
  the other columns time the CPU, and so would a training step made of such GEMMs.
steps: train.py's build_training and train_step (bench_speed.py's runner and timing: seq 2048,
micro-batch 16, synthetic tokens, bf16 parameters, fused AdamW), each row in its own process:
  "ours defaults"                  bf16, the GPU defaults (kernels triton, our loss, selective)
  "ours fp8 tensorwise"            the defaults with training.fp8=tensorwise
  "ours fp8 tensorwise_delayed"    the defaults with training.fp8=tensorwise_delayed
  "ours fp8 rowwise"               the defaults with training.fp8=rowwise
  "ours fp8 rowwise_bf16_dw"       the defaults with training.fp8=rowwise_bf16_dw
  "ours compile"                   bf16, kernels torch + training.compile, our loss
  "ours fp8 tensorwise compile"    the same with training.fp8=tensorwise
  "ours fp8 tensorwise_delayed compile"   ... tensorwise_delayed
  "ours fp8 rowwise compile"       the same with training.fp8=rowwise
  "hf+liger"                       transformers + liger-kernel, bf16: the ratios' reference
The fp8 rows run the casts (or amaxes) fused into the SwiGLU kernels, as training does.
A label ending in " fp32-master" keeps fp32 master weights and AdamW moments; one ending in
" compiled casts" (before it) runs the previous casts: torch.compile'd, weights cast per use;
one ending in " unfused casts" (before those) turns fp8_fused.FUSED off: the separate casts.

Measured: bench/NOTES.md.
"""
import argparse
import json
import os
import subprocess
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_speed  # noqa: E402  (puts the repository on sys.path)
import train  # noqa: E402
from fp8_baselines import PreviousCasts, gemms_alone, layer_gemms  # noqa: E402
from fused_projections import bench, fwd_bwd, host_ms  # noqa: E402
from picotron.config import config_from_dict  # noqa: E402
from picotron.speed.fp8 import linear as fp8, fused as fp8_fused  # noqa: E402
from picotron.speed.fp8.triton_layers import fp8_swiglu_mlp  # noqa: E402
from picotron.speed.fp8.weights import Fp8WeightCache, WeightCasts  # noqa: E402
from picotron.speed.kernels.fused_linear import fused_linear  # noqa: E402
from picotron.speed.kernels.triton_swiglu import swiglu_linear  # noqa: E402
from picotron.utils import flops_per_token  # noqa: E402

# label: (kernels, fused_loss, compile, activation checkpointing, training.fp8)
ROWS = {"ours defaults": ("auto", "auto", False, "auto", "none"),
        "ours fp8 tensorwise": ("auto", "auto", False, "auto", "tensorwise"),
        "ours fp8 tensorwise_delayed": ("auto", "auto", False, "auto", "tensorwise_delayed"),
        "ours fp8 rowwise": ("auto", "auto", False, "auto", "rowwise"),
        "ours fp8 rowwise_bf16_dw": ("auto", "auto", False, "auto", "rowwise_bf16_dw"),
        "ours compile": ("torch", "triton", True, "none", "none"),
        "ours fp8 tensorwise compile": ("torch", "triton", True, "none", "tensorwise"),
        "ours fp8 tensorwise_delayed compile": ("torch", "triton", True, "none",
                                                "tensorwise_delayed"),
        "ours fp8 rowwise compile": ("torch", "triton", True, "none", "rowwise")}


VARIANTS = ("cached", "unfused", "per use", "compiled", "eager", "alone", "host")



def time_variant(variant, x, ws, recipe):
    inputs = [x, *ws]
    if variant == "alone":
        return bench(gemms_alone(x, ws, recipe))
    if variant == "host":
        cache = Fp8WeightCache()
        return host_ms(fwd_bwd(lambda: fp8.fp8_linear(x, ws, recipe, cache=cache), inputs))
    if variant in ("compiled", "eager"):
        with PreviousCasts(compile=variant == "compiled"):
            return bench(fwd_bwd(lambda: fp8.fp8_linear(x, ws, recipe), inputs))
    cache = Fp8WeightCache() if variant == "cached" else None
    return bench(fwd_bwd(lambda: fp8.fp8_linear(x, ws, recipe, cache=cache), inputs))


def time_mlp(variant, x, ws, w_down, x_i, recipe):
    """The mlp row: gate/up (ws), the SwiGLU and down (w_down) as "selective" runs them.
    "alone": the two projections' GEMMs alone (x_i: an (N, I) input for down's)."""
    r = fp8.recipe_of(recipe)
    if variant == "alone":
        gate_up, down = gemms_alone(x, ws, recipe), gemms_alone(x_i, [w_down], recipe)
        return bench(lambda: (gate_up(), down()))
    caches = (Fp8WeightCache(), Fp8WeightCache()) if variant in ("cached", "unfused", "host") \
        else (None, None)
    step = fwd_bwd(lambda: fp8_swiglu_mlp(x, ws, w_down, r, None, None, *caches),
                   [x, *ws, w_down])
    if variant == "host":
        return host_ms(step)
    fused = fp8_fused.FUSED
    try:
        fp8_fused.FUSED = variant != "unfused"
        if variant in ("compiled", "eager"):
            with PreviousCasts(compile=variant == "compiled"):
                return bench(step)
        return bench(step)
    finally:
        fp8_fused.FUSED = fused


def gemms(args):
    variants = [v for v in args.variants.split(",") if v]
    assert set(variants) <= set(VARIANTS), f"--variants: pick from {VARIANTS}"
    for shape in args.shapes.split(","):
        cfg = config_from_dict(bench_speed.base_config(shape, args.mbs, args.seq)).model
        print(f"== {shape}: {args.mbs * args.seq} tokens, ms per layer, fwd + bwd")
        totals, mlp_totals, rows = {}, {}, layer_gemms(cfg, args.mbs * args.seq)
        for name, x, ws in rows:
            times = {"bf16": bench(fwd_bwd(lambda: fused_linear(x, ws), [x, *ws]))}
            if "host" in variants:
                times["bf16 host"] = host_ms(fwd_bwd(lambda: fused_linear(x, ws), [x, *ws]))
            for recipe in fp8.RECIPES:
                for variant in variants:     # "unfused": nothing to fuse in one projection
                    times[f"{recipe} {variant}"] = time_variant(
                        "cached" if variant == "unfused" else variant, x, ws, recipe)
            report(name, times, [totals] + ([mlp_totals] if name in ("q/k/v", "o") else []))
        report("layer", totals, ratios=True)
        (_, x, gate_up), (_, x_i, (w_down,)) = rows[2], rows[3]
        times = {"bf16": bench(fwd_bwd(lambda: swiglu_linear(fused_linear(x, gate_up), w_down),
                                       [x, *gate_up, w_down]))}
        for recipe in fp8.RECIPES:
            for variant in variants:
                times[f"{recipe} {variant}"] = time_mlp(variant, x, gate_up, w_down, x_i,
                                                        recipe)
        report("mlp", times, [mlp_totals])
        report("layer mlp", mlp_totals, ratios=True)


def report(name, times, totals=(), ratios=False):
    """Print a row's times (and their bf16 / time ratios), adding them to each of `totals`."""
    print(f"  {name:9s} " + "  ".join(
        f"{k} {v:.3f}" + (f" ({times['bf16'] / v:.2f}x)" if ratios else "")
        for k, v in times.items()), flush=True)
    for total in totals:
        for k, v in times.items():
            total[k] = total.get(k, 0.0) + v


def uncached(cache, weights, w, rowwise, in_group, out_group, transposed):
    """Fp8WeightCache.get that never keeps anything: the weights cast at every use."""
    return WeightCasts(w, rowwise, in_group, out_group, transposed)


def child(args):
    """One row of `steps`, in this process: prints RESULT [tokens/s, peak GB, loss, clock]."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    train.materialize = bench_speed.cached_materialize
    label, shape, master = args.one, args.shapes, args.one.endswith(" fp32-master")
    base = label.removesuffix(" fp32-master")
    if base.endswith(" compiled casts"):            # the previous casts, for the whole run
        base = base.removesuffix(" compiled casts")
        PreviousCasts(compile=True).__enter__()
        Fp8WeightCache.get = uncached
    if base.endswith(" unfused casts"):             # the casts as separate kernels
        base = base.removesuffix(" unfused casts")
        fp8_fused.FUSED = False
    if base == "hf+liger":
        make = lambda: bench_speed.hf_runner(shape, args.mbs, args.seq, True, False)  # noqa
    else:
        kernels, loss, compile_, ckpt, recipe = ROWS[base]
        make = lambda: bench_speed.ours_runner(shape, args.mbs, args.seq, master,  # noqa
                                               kernels, loss, compile_, ckpt, "sdpa",
                                               fp8=recipe)
    print("RESULT " + json.dumps(bench_speed.measure(make, 3, 6, args.mbs, args.seq)))


def steps(args):
    labels = [x for x in args.rows.split(",") if x] or list(ROWS) + ["hf+liger"]
    for shape in args.shapes.split(","):
        cfg = config_from_dict(bench_speed.base_config(shape, args.mbs, args.seq)).model
        print(f"== {shape}, seq {args.seq}, micro-batch {args.mbs}", flush=True)
        results = {}
        for label in labels:
            cmd = [sys.executable, os.path.abspath(__file__), "steps", "--one", label,
                   "--shapes", shape, "--mbs", str(args.mbs), "--seq", str(args.seq)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(found[-1][7:]) if found else f"CRASH: {proc.stderr[-300:]}"
            if isinstance(r, str):
                print(f"  {label:34s} {r}", flush=True)
                continue
            results[label] = r
            mfu = 100 * r[0] * flops_per_token(cfg, args.seq) / bench_speed.PEAK
            print(f"  {label:34s} {r[0]:>9,.0f} tok/s  MFU(bf16 peak) {mfu:5.1f}%  peak "
                  f"{r[1]:6.1f} GB  held {r[4]:6.1f} GB  loss {r[2]:.3f}  {r[3]}", flush=True)
        ref = results.get("hf+liger")
        for label, r in results.items():
            if ref:
                print(f"  {label:34s} {r[0] / ref[0]:.2f}x HF+Liger tokens/s, "
                      f"{r[1] / ref[1]:.2f}x its peak memory, {r[4] / ref[4]:.2f}x its held")


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=("gemms", "steps"),
                   help="gemms: one layer's projections; steps: training steps")
    p.add_argument("--shapes", default="SmolLM-360M,SmolLM-1.7B", help="presets (%(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--rows", default="", help="steps: comma-separated labels (default: all)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="gemms: comma-separated FP8 columns (default: %(default)s)")
    p.add_argument("--fused_tile", default="",
                   help="gemms: fp8_fused.TILE as ROWS,BLOCK,WARPS (default: the module's)")
    p.add_argument("--one", help=argparse.SUPPRESS)      # child: run this one row
    args = p.parse_args()
    if args.fused_tile:
        fp8_fused.TILE = tuple(int(v) for v in args.fused_tile.split(","))
    if args.one:
        return child(args)
    return gemms(args) if args.part == "gemms" else steps(args)


if __name__ == "__main__":
    main()
