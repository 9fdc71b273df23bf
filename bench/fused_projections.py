"""Microbench: fused projections and the packed SwiGLU against the separate reference ops.

    python bench/fused_projections.py [--shapes 360M,1.7B] [--batch 16] [--seq 2048]

Per shape, forward + backward times (CUDA events over 20 back-to-back runs), bf16:
- q/k/v and gate/up: three (two) F.linear against one fused_linear;
- swiglu: model.py's swiglu on separate gate/up outputs, against swiglu_packed on the packed
  one (forward alone too), with the bandwidth it reaches (fwd 3I, bwd 5I elements a token);
- the whole MLP block, down(swiglu(gate(x), up(x))), separate against fused: time and peak
  memory above what the inputs hold.

H200, 2026-11-29, batch 16 x 2048 (ms, fwd+bwd unless said):
                     360M separate / fused     1.7B separate / fused
  q/k/v              0.969 / 0.582             3.395 / 3.492
  gate/up            1.359 / 1.299             9.585 / 9.681
  swiglu fwd         0.207 / 0.127 (3.97 TB/s) 0.681 / 0.389 (4.14 TB/s)
  swiglu             0.558 / 0.407             1.765 / 1.045 (4.11 TB/s)
  MLP block          2.543 / 2.396             16.012 / 15.879
  MLP peak memory    1025 / 705 MB             3232 / 2208 MB
"""
import argparse
import os
import sys

import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.speed.kernels.fused_linear import fused_linear                      # noqa: E402
from picotron.speed.kernels.triton_swiglu import swiglu_packed                    # noqa: E402

SHAPES = {"360M": (960, 320, 2560), "1.7B": (2048, 2048, 8192)}        # C, kv dim, I



def swiglu(gate, up):
    """The reference activation, as model.swiglu_in computes it from the two projections."""
    return F.silu(gate) * up

def bench(fn, reps=20):
    """Milliseconds per fn() over reps back-to-back runs after 3 warm-ups: the launches queue
    ahead of the GPU, as in training, so Python's launch time is hidden where it would be."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def host_ms(fn, reps=20):
    """Milliseconds of CPU per fn(), the GPU left to run behind (reps calls queue far fewer
    launches than CUDA's queue holds, so the CPU never waits for the GPU): what `bench`
    measures instead when the CPU is the slower of the two."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    ms = (time.perf_counter() - start) / reps * 1e3
    torch.cuda.synchronize()
    return ms


def fwd_bwd(make, inputs):
    """A function that runs make() (an output or a tuple of them) and the gradients w.r.t.
    inputs for fixed dys (torch.autograd.grad: nothing accumulates between runs)."""
    dys = []

    def step():
        outs = make()
        outs = outs if isinstance(outs, tuple) else (outs,)
        if not dys:
            dys.extend(torch.randn_like(o) for o in outs)
        return torch.autograd.grad(outs, inputs, dys)
    return step


def peak_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="360M,1.7B", help="comma-separated, among "
                    f"{', '.join(SHAPES)} (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="micro-batch size (default: 16)")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    args = ap.parse_args()
    N = args.batch * args.seq
    for name in args.shapes.split(","):
        C, KV, I = SHAPES[name]
        print(f"== {name}: x ({args.batch}, {args.seq}, {C}) bf16, q/k/v {C}/{KV}/{KV}, I {I}")
        w = lambda o, i=C: (torch.randn(o, i, device="cuda") * i ** -0.5).bfloat16()  # noqa
        x = torch.randn(args.batch, args.seq, C, device="cuda").bfloat16().requires_grad_()
        for label, outs in (("q/k/v", (C, KV, KV)), ("gate/up", (I, I))):
            ws = [w(o).requires_grad_() for o in outs]
            sep = bench(fwd_bwd(lambda: tuple(F.linear(x, wi) for wi in ws), [x, *ws]))
            fused = bench(fwd_bwd(lambda: fused_linear(x, ws), [x, *ws]))
            w_cat = torch.cat(ws).detach().requires_grad_()         # the GEMMs without the cats
            one = bench(fwd_bwd(lambda: F.linear(x, w_cat), [x, w_cat]))
            print(f"{label:8s} fwd+bwd: separate {sep:.3f} ms, fused_linear {fused:.3f} ms "
                  f"(one F.linear on a stored concatenation {one:.3f} ms)")
        gu0 = torch.randn(args.batch, args.seq, 2 * I, device="cuda").bfloat16()
        g0, u0 = (t.contiguous() for t in gu0.chunk(2, -1))
        gu, g, u = (t.clone().requires_grad_() for t in (gu0, g0, u0))
        gb = N * I * 2 / 1e9                                            # GB per I-wide tensor
        t_ref = bench(lambda: swiglu(g0, u0))
        t_fast = bench(lambda: swiglu_packed(gu0))
        print(f"swiglu   fwd: reference {t_ref:.3f} ms, packed {t_fast:.3f} ms "
              f"({3 * gb / t_fast:.2f} TB/s)")
        # gu a leaf: backward writes a fresh d(gu), the same bytes as the in-place path
        t_ref = bench(fwd_bwd(lambda: swiglu(g, u), [g, u]))
        t_fast = bench(fwd_bwd(lambda: swiglu_packed(gu), [gu]))
        print(f"swiglu   fwd+bwd: reference {t_ref:.3f} ms, packed {t_fast:.3f} ms "
              f"({8 * gb / t_fast:.2f} TB/s)")
        wg, wu, wd = w(I).requires_grad_(), w(I).requires_grad_(), w(C, I).requires_grad_()
        ref_mlp = fwd_bwd(lambda: F.linear(swiglu(F.linear(x, wg), F.linear(x, wu)), wd),
                          [x, wg, wu, wd])
        fused_mlp = fwd_bwd(lambda: F.linear(swiglu_packed(fused_linear(x, [wg, wu])), wd),
                            [x, wg, wu, wd])
        for label, fn in (("separate", ref_mlp), ("fused", fused_mlp)):
            t = bench(fn)
            print(f"MLP      fwd+bwd {label:8s}: {t:.3f} ms, peak +{peak_mb(fn):.0f} MB")
        del x, gu0, g0, u0, gu, g, u
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
