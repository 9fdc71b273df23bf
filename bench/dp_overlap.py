"""Where data parallelism's time goes: gradient reductions against backward, under the profiler.

    python bench/dp_overlap.py [--model SmolLM-360M] [--mbs 16] [--variants NAME,...] [--out DIR]
    python bench/dp_overlap.py --cpu --model debug --mbs 2 --seq 64      # a dry run on gloo

Each variant is one `torchrun train.py`-style run (this file re-launched under torchrun, building
the training exactly as train.py does) on 1 or 2 GPUs; after 5 warm-up steps, 5 steps are timed
as they are, then 3 run under torch.profiler on rank 0. Per variant it prints:

    unprofiled ms per step without the profiler (host clock over 5 queued steps)
    wall       ms per step of the profiled steps (host clock; the profiler adds its overhead)
    compute    ms per step of kernels other than NCCL's (their union over streams)
    nccl       ms per step of NCCL kernels
    exposed    ms per step when an NCCL kernel runs and no compute kernel does: communication
               the step waits for (wall - compute is everything the compute stream did not do:
               exposed communication plus host gaps)
    slowdown   compute ms over the one-GPU run's compute ms: what sharing the GPU with NCCL's
               kernels (SMs, memory bandwidth) costs the matmuls and norms
    launched   buckets whose reduction started during backward, of all buckets (the rest start
               in finish(), after backward)

so a variant's lost time splits into exposed communication, slower compute, and host gaps.
The variants (`--variants`, default all): "1gpu", "dp2" (today's default: fp32 buffers, 25 MB
buckets, overlapped), "dp2-no-overlap", "dp2-bucket100" (100 MB buckets), "dp2-bf16"
(distributed.grad_reduce_dtype=bfloat16), "dp2-bf16-bucket100", "dp2-zero1", "dp2-zero2".
"""
import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

VARIANTS = {          # name: (GPUs, extra create_config flags)
    "1gpu": (1, []),
    "dp2": (2, ["--dp", "2"]),
    "dp2-no-overlap": (2, ["--dp", "2", "--set", "distributed.overlap_grad_reduce=false"]),
    "dp2-bucket100": (2, ["--dp", "2", "--set", "distributed.bucket_size_mb=100"]),
    "dp2-bf16": (2, ["--dp", "2", "--set", "distributed.grad_reduce_dtype=bfloat16"]),
    "dp2-bf16-bucket100": (2, ["--dp", "2", "--set", "distributed.grad_reduce_dtype=bfloat16",
                               "--set", "distributed.bucket_size_mb=100"]),
    "dp2-zero1": (2, ["--dp", "2", "--zero_stage", "1"]),
    "dp2-zero2": (2, ["--dp", "2", "--zero_stage", "2"]),
}


def union_ms(intervals):
    """Total length of the union of (start, end) intervals, in the profiler's us -> ms."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return (total + (0 if cur_e is None else cur_e - cur_s)) / 1e3


def exposed_ms(comm, compute):
    """Time covered by `comm` intervals and by no `compute` interval, in ms."""
    return union_ms(comm + compute) - union_ms(compute)


def profile_rank(args):
    """Under torchrun: build the training as train.py does, warm up, profile rank 0."""
    import torch
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import train
    from picotron.data.windows import StepBatches, build_train_val
    config, pgm, device = train.setup(args.config)
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    data, _ = build_train_val(config)
    batches = StepBatches(data, config, pgm, device)
    batches.prefetch(0)

    during_backward = []               # buckets launched before finish() started the rest
    finish = grads.finish

    def counted_finish():
        during_backward.append(len(getattr(grads, "launch_log", [])))
        finish()
    grads.finish = counted_finish

    def step(i):
        train.queue_step(model, loss_fn, grads, optimizer, batches, i, config, pgm, device)
    for i in range(5):
        step(i)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    import time
    began, plain = time.perf_counter(), 5       # the same loop without the profiler
    for i in range(5, 5 + plain):
        step(i)
    sync()
    plain_ms = (time.perf_counter() - began) * 1e3 / plain
    n, first = 3, 5 + plain
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) if pgm.global_rank == 0 else \
            contextlib.nullcontext() as prof:
        began = time.perf_counter()
        for i in range(first, first + n):
            step(i)
        sync()
        wall_ms = (time.perf_counter() - began) * 1e3 / n
    if pgm.global_rank == 0:
        comm, compute = [], []
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                (comm if "nccl" in e.name.lower() else compute).append(
                    (e.time_range.start, e.time_range.end))
        buckets = len(getattr(grads, "buckets", []))
        print("RESULT " + json.dumps({
            "plain_ms": plain_ms, "wall_ms": wall_ms, "compute_ms": union_ms(compute) / n,
            "nccl_ms": union_ms(comm) / n, "exposed_ms": exposed_ms(comm, compute) / n,
            "launched": f"{min(during_backward[-n:])}/{buckets}",
            "peak_gb": (torch.cuda.max_memory_allocated() / 2 ** 30
                        if device.type == "cuda" else 0.0)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_variant(args, name):
    import create_config
    from multi_gpu import free_port
    gpus, flags = VARIANTS[name]
    out = os.path.join(args.out, "runs")
    with contextlib.redirect_stdout(io.StringIO()):
        path = create_config.main(
            ["--out_dir", out, "--exp_name", name, "--model_name", args.model, "--mbs",
             str(args.mbs), "--seq_len", str(args.seq), "--dataset_name", "synthetic",
             "--total_train_steps", "16", "--set", "training.dtype=bfloat16",
             "--set", "training.master_weights=false", "--set", "checkpoint.save_frequency=0",
             "--set", "training.fp8=none", "--set", "training.cuda_graphs=false"]
            + (["--use_cpu"] if args.cpu else []) + flags)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
           "--master_port", str(free_port()), os.path.abspath(__file__),
           "--rank_config", path]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return f"FAILED rc={proc.returncode}: {proc.stderr.strip()[-800:]}"


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM-360M", help="model preset (default: %(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--cpu", action="store_true", help="gloo CPU ranks (a dry run: no kernels)")
    p.add_argument("--out", default=os.environ.get("OUT", "dp_overlap_out"),
                   help="folder of dp_overlap.txt and the runs' configs (default: $OUT)")
    p.add_argument("--rank_config", help=argparse.SUPPRESS)     # set when under torchrun
    args = p.parse_args()
    if args.rank_config:
        args.config = args.rank_config
        return profile_rank(args)
    os.makedirs(args.out, exist_ok=True)
    lines, base = [], None
    for name in args.variants.split(","):
        r = run_variant(args, name)
        if isinstance(r, str):
            line = f"{name:20s} {r}"
        else:
            base = r["compute_ms"] if name == "1gpu" else base
            slow = r["compute_ms"] / base if base else float("nan")
            line = (f"{name:20s} unprofiled {r['plain_ms']:7.1f} ms  profiled: wall "
                    f"{r['wall_ms']:7.1f}  compute {r['compute_ms']:7.1f}  "
                    f"nccl {r['nccl_ms']:6.1f}  exposed {r['exposed_ms']:5.1f}  slowdown "
                    f"{slow:5.3f}  launched {r['launched']:>6s}  peak {r['peak_gb']:5.1f} GB")
        print(line, flush=True)
        lines.append(line)
    with open(os.path.join(args.out, "dp_overlap.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
