"""Where one training step's GPU time goes: our rows against HF + Liger, kernel by kernel.

    python bench/profile_step.py [--shapes SmolLM-360M,SmolLM-1.7B] [--rows "ours liger,hf+liger"]
                                 [--gemm] [--attn_backends] [--out DIR]

Each row runs in its own process through bench_speed.py's runners (the same models, data and
optimizers as the benchmark): 3 warm-up steps, then 2 steps under torch.profiler. Per row it
prints the wall time per step, the GPU busy time per step (the union of kernel intervals; wall
minus busy is time the GPU waited on the CPU), kernel time by category, and the aten ops with
the most device time. `--gemm` adds a matmul microbench: the separate q/k/v and gate/up
projections against one fused matmul each, forward plus both backward products (dX, dW), which
predicts what fusing the projections can buy; `--attn_backends` times one layer's SDPA under
each backend (flash, cuDNN, memory-efficient). Full tables go to DIR/profile_<shape>_<row>.txt.
The "ours auto" row also prints each category's time against its memory-traffic floor at 4 TB/s:
the bytes its kernels must move (bench/traffic_floor.py).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

from traffic_floor import BANDWIDTH, off_path, traffic_floor  # noqa: E402

CATEGORIES = [          # first match wins; kernel names as the profiler reports them
    ("attention", r"cudnn|flash|fmha|sdpa|attention"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|wgmma|sm90_|Kernel2"),
    ("optimizer", r"multi_tensor|adam|foreach|Adam"),
    # Triton kernels, ours (picotron/speed) and liger's, by what they compute
    ("swiglu", r"swiglu|_h_tile|^_tile$|_store_both"),
    ("norms", r"_norm_fwd|_norm_bwd|rms_norm|layer_norm"),
    ("rope", r"_rope|rotary"),
    ("fp8 casts, amaxes", r"_cast|_amax|_fp8_|_scales|_rowwise"),
    ("loss", r"cross_entropy|^_scale$"),
    ("triton", r"_kernel$|triton|liger"),
    ("adds", r"CUDAFunctor_add|AddFunctor"),     # residual adds, gradients summed
    ("copy/cat", r"copy|cat|Memcpy|Memset|memset|fill"),
    ("reduction", r"reduce|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("embedding", r"embedding|index|scatter|gather|sort|radix"),
]


def category(name):
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def profile_row(args):
    """Child process: profile `args.one` on `args.shapes` and print one JSON summary line."""
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import bench_speed
    import train
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    train.materialize = bench_speed.cached_materialize
    step, config = bench_speed.maker(args.one, args.shapes, args.mbs, args.seq)()
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    steps = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(3, 3 + steps):
            step(i)
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / steps
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_cat, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_cat[category(e.name)] += us / 1e3 / steps
        by_name[e.name][0] += us / 1e3 / steps
        by_name[e.name][1] += 1
        intervals.append((e.time_range.start, e.time_range.end, e.name))
    intervals.sort()
    # Idle gaps: where the GPU waited for the CPU, with the kernels on either side and the
    # gap's position in the profiled window (0 = first kernel, 1 = last).
    t0, t1 = intervals[0][0], max(t for _, t, _ in intervals)
    gaps, reach = [], intervals[0][1]
    for (s, t, name), (_, _, prev) in zip(intervals[1:], intervals):
        if s - reach > 20:
            gaps.append((s - reach, round((reach - t0) / (t1 - t0), 3), prev[:60], name[:60]))
        reach = max(reach, t)
    gaps.sort(key=lambda g: -g[0])
    busy, cur_s, cur_e = 0.0, None, None
    for s, t, _ in intervals:                   # union of kernel intervals (several streams)
        if cur_e is None or s > cur_e:
            busy += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    busy += 0 if cur_e is None else cur_e - cur_s
    ops = sorted(((a.key, a.self_device_time_total / 1e3 / steps, a.count // steps)
                  for a in prof.key_averages() if a.device_type == DeviceType.CPU
                  and a.self_device_time_total > 0), key=lambda r: -r[1])
    top = sorted(((n, ms, c // steps) for n, (ms, c) in by_name.items()), key=lambda r: -r[1])
    floor_ms = {}       # "ours auto": the bytes each category must move, at BANDWIDTH
    if args.one == "ours auto" and not off_path(config):
        floor_ms = {cat: nbytes / BANDWIDTH * 1e3
                    for cat, (nbytes, _) in traffic_floor(config).items()}
    print("RESULT " + json.dumps({
        "wall_ms": wall_ms, "busy_ms": busy / 1e3 / steps, "kernel_ms": sum(by_cat.values()),
        "peak_gb": torch.cuda.max_memory_allocated() / 2 ** 30,
        "by_cat": dict(by_cat), "top_kernels": top[:40], "top_ops": ops[:30],
        "gaps_ms": sum(g[0] for g in gaps) / 1e3 / steps, "n_gaps": len(gaps) // steps,
        "top_gaps": gaps[:25], "floor_ms": floor_ms}))


def gemm_bench(emit, shape, mbs, seq):
    """Separate projections vs one fused matmul: forward Y = X W^T, backward dX = dY W and
    dW = dY^T X (the separate version also adds the dX of each projection)."""
    from picotron.config.presets import resolve_model
    m = resolve_model(shape)
    C, I = m["hidden_size"], m["intermediate_size"]
    kv = m["num_key_value_heads"] * C // m["num_attention_heads"]
    M = mbs * seq
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)

    def timed(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(15):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    for name, outs in (("qkv", [C, kv, kv]), ("gate_up", [I, I])):
        ws = [torch.randn(o, C, device="cuda", dtype=torch.bfloat16) * 0.02 for o in outs]
        wcat = torch.cat(ws)
        dys = [torch.randn(M, o, device="cuda", dtype=torch.bfloat16) for o in outs]
        dycat = torch.cat(dys, dim=1)

        def separate():
            for w in ws:
                x @ w.t()
            dx = dys[0] @ ws[0]
            for dy, w in zip(dys[1:], ws[1:]):
                dx = dx + dy @ w
            for dy in dys:
                dy.t() @ x

        def fused():
            x @ wcat.t()
            dycat @ wcat
            dycat.t() @ x
        flops = 6 * M * C * sum(outs)
        ts, tf = timed(separate), timed(fused)
        emit(f"  gemm {name:8s} separate {ts:6.3f} ms ({flops / ts / 1e9:.0f} TFLOP/s)  fused "
             f"{tf:6.3f} ms ({flops / tf / 1e9:.0f} TFLOP/s)  saves {ts - tf:.3f} ms per layer")


def attention_backends(emit, shape, mbs, seq):
    """Forward + backward time of one layer's SDPA call under each backend, (B, H, T, D) bf16,
    causal: which kernel `model.attn_implementation="sdpa"` should prefer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from picotron.config.presets import resolve_model
    m = resolve_model(shape)
    H, K = m["num_attention_heads"], m["num_key_value_heads"]
    D = m["hidden_size"] // H
    q = torch.randn(mbs, H, seq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(mbs, K, seq, D, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    flops = 4 * mbs * H * seq * seq * D * 3.5 / 2     # fwd 2 matmuls, bwd 5; causal half
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        for gqa in ((True, False) if H != K else (False,)):
            try:
                def f():
                    kk, vv = (k, v) if gqa or H == K else (k.repeat_interleave(H // K, 1),
                                                           v.repeat_interleave(H // K, 1))
                    with sdpa_kernel(backend):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            q, kk, vv, is_causal=True, enable_gqa=gqa and H != K)
                    out.backward(torch.ones_like(out))
                for _ in range(3):
                    f()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(10):
                    f()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) / 10 * 1e3
                emit(f"  sdpa {backend.name:22s} gqa={gqa!s:5s} {ms:7.2f} ms fwd+bwd per layer"
                     f" ({flops / ms / 1e9:.0f} TFLOP/s causal)")
            except Exception as e:
                emit(f"  sdpa {backend.name:22s} gqa={gqa!s:5s} unavailable: "
                     f"{type(e).__name__}: {str(e)[:80]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM-360M,SmolLM-1.7B",
                   help="model presets, comma-separated (default: %(default)s)")
    p.add_argument("--rows", default="ours liger,hf+liger", help="bench_speed.py's row "
                   "labels, comma-separated (default: %(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--gemm", action="store_true",
                   help="add the matmul microbench: separate against fused projections")
    p.add_argument("--attn_backends", action="store_true",
                   help="add one layer's attention timed under each SDPA backend")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the "
                   "profile_*.txt tables (default: $OUT, else the current folder)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return profile_row(args)
    lines = []

    def emit(text):
        print(text, flush=True)
        lines.append(text)
    for shape in args.shapes.split(","):
        emit(f"== {shape}, mbs {args.mbs}, seq {args.seq}")
        if args.gemm:
            gemm_bench(emit, shape, args.mbs, args.seq)
        if args.attn_backends:
            attention_backends(emit, shape, args.mbs, args.seq)
        for label in args.rows.split(","):
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", label,
                                   "--shapes", shape, "--mbs", str(args.mbs), "--seq",
                                   str(args.seq)], capture_output=True, text=True, timeout=300)
            found = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not found:
                emit(f"{label}: CRASH {proc.stderr.strip()[-400:]}")
                continue
            r = json.loads(found[-1][7:])
            cats = "  ".join(f"{k} {v:.1f}" for k, v in sorted(r["by_cat"].items(),
                                                                 key=lambda kv: -kv[1]))
            emit(f"{label:24s} wall {r['wall_ms']:.1f} ms/step, GPU busy {r['busy_ms']:.1f}, "
                 f"kernels {r['kernel_ms']:.1f}, peak {r['peak_gb']:.1f} GB\n    {cats}\n"
                 f"    idle gaps > 20 us: {r['n_gaps']} per step, {r['gaps_ms']:.1f} ms")
            if r["floor_ms"]:       # measured against its memory-traffic floor (traffic_floor.py)
                emit(f"    measured / floor ms at {BANDWIDTH / 1e12:.1f} TB/s: " + "  ".join(
                    f"{cat} {r['by_cat'].get(cat, 0.0):.1f}/{ms:.1f}"
                    for cat, ms in r["floor_ms"].items()))
            name = label.replace(" ", "_").replace("+", "plus")
            path = os.path.join(args.out, f"profile_{shape}_{name}.txt")
            with open(path, "w") as f:
                f.write(f"{label} {shape}\n" + json.dumps(r["by_cat"], indent=1) + "\n")
                f.write("\n# kernels: ms/step, launches/step, name\n")
                f.writelines(f"{ms:8.2f} {c:5d}  {n[:160]}\n" for n, ms, c in r["top_kernels"])
                f.write("\n# largest idle gaps: us, position in window, kernel before -> after\n")
                f.writelines(f"{g:8.0f} {p:6.3f}  {a} -> {b}\n" for g, p, a, b in r["top_gaps"])
                f.write("\n# aten ops by self device time: ms/step, calls/step, op\n")
                f.writelines(f"{ms:8.2f} {c:5d}  {n}\n" for n, ms, c in r["top_ops"])
    with open(os.path.join(args.out, "profile_summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
