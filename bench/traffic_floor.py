"""The memory-traffic floor of one training step, by profile category: the bytes our kernels
read and write per optimizer step, counted from their loads and stores as they are written,
and the time that takes at a given bandwidth.

    python bench/traffic_floor.py [--shapes SmolLM-360M,SmolLM-1.7B] [--mbs 16] [--seq 2048]
                                  [--bandwidth 4.0e12]

The categories are bench/profile_step.py's (the matmuls and attention are left out: they are
bound by FLOPs, bench/matmul_floor.py gives their floor). Next to a profile, a category near
its floor can only get faster by moving fewer bytes; one far above it has slack in its kernels.
The path counted is what a run with no flag takes on an H100/H200 at large width: our Triton
kernels with fused q/k/v and gate/up projections, the Triton loss, "selective" recomputation
(the SwiGLU output recomputed in backward), delayed-scaled FP8 GEMMs, fp32 master weights and
AdamW moments for bf16 parameters, bf16 gradient buffers (one micro-batch, one GPU); CUDA graphs
where "auto" takes them (below hidden size 2048). bf16 GEMMs (training.fp8="none") and bf16
moments (master_weights=false, as bench_speed.py's "ours auto" row runs) are counted too.

The counting itself lives in the plan wing (picotron/plan/traffic.py: every pass, its kernel,
its symbols), where the step-time model also reads it; this script checks that a config takes
the path counted and prints the floor.
"""
import argparse
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

from bench_config import base_config  # noqa: E402
from picotron.config import config_from_dict  # noqa: E402
from picotron.plan.traffic import step_traffic, symbols  # noqa: E402

BANDWIDTH = 4.0e12      # B/s: an H200's practical HBM rate (its copy kernels reach 4.1-4.2e12)


def no_flag_config(shape, mbs, seq):
    """A run with no flag on an H100/H200, on any machine: "auto" takes our kernels, loss and
    recomputation wherever the config says GPU; FP8, which "auto" takes only on a GPU with FP8
    tensor cores, is named. SDPA attention, as the bench rows run it."""
    raw = base_config(shape, mbs, seq)
    raw["model"]["attn_implementation"] = "sdpa"
    raw["training"]["fp8"] = "tensorwise_delayed"
    return config_from_dict(raw, world_size=1)


def off_path(config) -> list:
    """What in `config` differs from the path counted here ([] when nothing does)."""
    m, t, d = config.model, config.training, config.distributed
    counted = [("model.kernels", m.kernels, "triton"), ("model.norm_type", m.norm_type, "rmsnorm"),
               ("model.parallel_residual", m.parallel_residual, False),
               ("training.dtype", t.dtype, "bfloat16"),
               ("training.fused_loss", t.fused_loss, "triton"),
               ("training.activation_checkpointing", t.activation_checkpointing, "selective"),
               ("training.compile", t.compile, False),
               ("training.use_fused_adam", t.use_fused_adam, True),
               ("training.gradient_accumulation_steps", t.gradient_accumulation_steps, 1),
               ("dp*tp*pp*cp", d.dp_size * d.tp_size * d.pp_size * d.cp_size, 1)]
    problems = [f"{key}={value!r} (counted: {want!r})" for key, value, want in counted
                if value != want]
    if t.fp8 not in ("tensorwise_delayed", "none"):
        problems.append(f"training.fp8={t.fp8!r} (counted: 'tensorwise_delayed' or 'none')")
    recomputing = t.activation_checkpointing_layers
    if recomputing is not None and recomputing < m.num_hidden_layers:
        problems.append(f"training.activation_checkpointing_layers="
                        f"{t.activation_checkpointing_layers} (counted: every layer)")
    return problems


def traffic_floor(config) -> dict:
    """{profile category: (bytes per optimizer step, formula)} for the path counted
    (picotron/plan/traffic.py); a ValueError names what of `config` is not that path."""
    problems = off_path(config)
    if problems:
        raise ValueError("the traffic floor counts another path: " + "; ".join(problems))
    return step_traffic(config)


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM-360M,SmolLM-1.7B",
                   help="model presets, comma-separated; NAME@L keeps L layers "
                        "(default: %(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--bandwidth", type=float, default=BANDWIDTH,
                   help="bytes per second the floor's time assumes (default: %(default).2g)")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        config = no_flag_config(shape, args.mbs, args.seq)
        t, s = config.training, symbols(config)
        print(f"\n== {shape}, mbs {args.mbs}, seq {args.seq}: fp8 {t.fp8}, master weights "
              f"{t.master_weights}, CUDA graphs {t.cuda_graphs}, at {args.bandwidth:.3g} B/s")
        print("   " + "  ".join(f"{k}={v:,}" for k, v in s.items()))
        print(f"{'category':20s} {'GB/step':>8s} {'ms':>7s}  formula (bytes)")
        floors = traffic_floor(config)
        for category, (nbytes, formula) in floors.items():
            print(f"{category:20s} {nbytes / 1e9:8.2f} {nbytes / args.bandwidth * 1e3:7.2f}  "
                  f"{formula.replace('*', '')}")
        total = sum(nbytes for nbytes, _ in floors.values())
        print(f"{'total':20s} {total / 1e9:8.2f} {total / args.bandwidth * 1e3:7.2f}")


if __name__ == "__main__":
    main()
