"""The host's share of a step with `distributed.offload_optim_frac`: torch's foreach AdamW (the
reference, data_parallel/optimizer.py) against its fused CPU AdamW (speed/adamw.py's TritonAdamW).

    python bench/offload_adamw.py [--params 100000000] [--steps 5] [--dtype bfloat16]
        [--offload 1.0] [--host_only]

1. host AdamW: one step of torch's AdamW over `--params` fp32 masters on the CPU, cut into
   tensors of one default bucket (distributed.bucket_size_mb of fp32 elements) as the offloaded
   masters are; foreach, then fused, same gradients. Both are given a first, untimed step (it
   allocates the moments).
2. whole step (skipped with --host_only): DistributedAdamW.step and TritonAdamW.step on a
   model-free setup, `--params` weights in `--dtype` as a few (rows, 1024) matrices in gradient
   buckets, `--offload` of their optimizer state on the host: the gradient down, the clip, the
   host AdamW, the weights up, and (offload < 1, GPU only) the Triton kernel on the rest. On a
   CPU this is a dry run of the same path (the copies are memcpy; offload must be 1: the kernel
   would run in Triton's interpreter).

One line per variant: seconds per step (mean over --steps) and the speed-up over the first row
of its part.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.config import Config, DistributedConfig, TrainingConfig  # noqa: E402
from picotron.data_parallel import DistributedAdamW, GradBuckets  # noqa: E402
from picotron.process_group_manager import ProcessGroupManager  # noqa: E402

BUCKET = int(DistributedConfig().bucket_size_mb * 2 ** 20 // 4)     # fp32 elements a bucket


def sizes(n: int, multiple: int = 1) -> list:
    """n elements cut into bucket-sized pieces, each a multiple of `multiple`."""
    step = BUCKET // multiple * multiple
    return [min(step, n - i) for i in range(0, n, step)]


def seconds_per_step(step, steps: int, sync) -> float:
    step()                                           # the first step allocates the state
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def host_adamw(n: int, steps: int) -> dict:
    """{variant: s/step} of torch's AdamW on n fp32 CPU elements."""
    out = {}
    for variant in ("foreach", "fused"):
        gen = torch.Generator().manual_seed(0)
        masters = [torch.randn(k, generator=gen) * 0.02 for k in sizes(n)]
        for m in masters:
            m.grad = torch.randn(m.numel(), generator=gen) * 1e-3
        opt = torch.optim.AdamW(masters, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1, **{variant: True})
        out[variant] = seconds_per_step(opt.step, steps, lambda: None)
        del opt, masters
    return out


class Matrices(torch.nn.Module):
    """No model: n weights (rounded down to rows of 1024) as (rows, 1024) matrices, one per
    bucket."""
    def __init__(self, n, dtype, device):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(k // 1024, 1024, device=device).to(dtype) * 0.02)
            for k in sizes(n, 1024))


def whole_step(cls, n, steps, dtype, offload, device) -> float:
    """s/step of cls.step on Matrices(n) after a backward that gives every weight a gradient."""
    config = Config(training=TrainingConfig(dtype=dtype),
                    distributed=DistributedConfig(offload_optim_frac=offload,
                                                  use_cpu=device.type == "cpu"))
    model = Matrices(n, getattr(torch, dtype), device)
    pgm = ProcessGroupManager()
    grads = GradBuckets(model, pgm, config)
    optimizer = cls(grads, pgm, config)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    total = 0.0
    for i in range(steps + 1):
        grads.sync = True
        sum((w * 1e-3).sum() for w in model.weights).backward()
        grads.finish()
        sync()
        start = time.perf_counter()
        optimizer.step(3e-4)
        sync()
        total += (time.perf_counter() - start) if i else 0.0     # step 0 allocates the state
        grads.zero_grad()
    return total / steps


def report(title: str, times: dict) -> None:
    print(title)
    first = next(iter(times.values()))
    for name, t in times.items():
        print(f"  {name:<38} {t:8.3f} s/step  {first / t:5.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=100_000_000,
                   help="elements of optimizer state on the host (fp32 masters)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the weights' dtype in the whole-step part")
    p.add_argument("--offload", type=float, default=1.0,
                   help="distributed.offload_optim_frac in the whole-step part")
    p.add_argument("--host_only", action="store_true",
                   help="time the host AdamW only, not the optimizers' whole step")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert args.params >= 1024 and args.steps >= 1 and 0 < args.offload <= 1, vars(args)
    assert device.type == "cuda" or args.host_only or args.offload == 1, (
        "on a CPU the whole step needs --offload 1 (the kernel would run in Triton's "
        "interpreter), or pass --host_only")
    print(f"{args.params:,} elements, {torch.get_num_threads()} CPU threads, torch "
          f"{torch.__version__}, {device}")
    report(f"host AdamW, fp32, tensors of up to {BUCKET:,} elements:",
           host_adamw(args.params, args.steps))
    if args.host_only:
        return
    from picotron.speed.adamw import TritonAdamW
    times = {}
    for name, cls in (("DistributedAdamW (foreach, pageable)", DistributedAdamW),
                      ("TritonAdamW (fused, pinned)", TritonAdamW)):
        times[name] = whole_step(cls, args.params, args.steps, args.dtype, args.offload,
                                 device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(f"whole optimizer step, {args.dtype} weights, offload_optim_frac={args.offload}:",
           times)


if __name__ == "__main__":
    main()
