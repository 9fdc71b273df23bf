"""The "floor" row of bench/bench_speed.py: a training step of a shape that runs only its
matmuls and its attention, nothing else.

Why: on the H200 the GEMMs (cuBLAS) and causal attention (cuDNN, through SDPA) are ~89% of
a SmolLM-1.7B step, and Hugging Face + Liger runs the very same kernels. The tokens/s of a
step made of them alone is what no kernel work on norms, RoPE, SwiGLU, the loss or the
optimizer can beat; bench_speed prints it as a ratio to HF + Liger in the same call, under
the same power limit (bench/gpu_clock.py).

What one step queues, for micro-batch B, sequence T (N = B*T tokens), hidden C, MLP width F,
H query / K key-value heads of dim D, vocabulary V, L layers; shapes as train.py's path with
model.kernels=triton has them (fused q/k/v and gate/up projections, tied embedding head):
- per layer, forward: x (N, C) @ W_qkv^T (C+2KD, C); SDPA causal on q (B, H, T, D) and
  k, v (B, K, T, D), views of (B, T, heads, D) rows as our RoPE kernel writes them;
  (N, C) @ W_o^T; (N, C) @ W_gu^T (2F, C); (N, F) @ W_down^T (C, F);
- the head in 4096-token chunks (training.loss_chunk_tokens' default): logits (n, V) =
  x @ E^T, then d x = d logits @ E and d E += d logits^T @ x into an fp32 (V, C) sum;
- per layer, backward, last to first: each projection's input gradient (dy @ W) and weight
  gradient (dy^T @ x), and SDPA's backward.
One set of weights and activations serves every layer (each operand is larger than the
50 MB L2, so each GEMM streams from memory as in the model). No optimizer, no norms, no
elementwise work: those are what the floor leaves out.

`fp8=True` (bench_speed's "floor fp8" row) is the floor of the default FP8 path
(speed/fp8/linear.py): the projections' three GEMMs each run as `torch._scaled_mm` on operands
already cast (x, h and the weights in e4m3, the output gradients in e5m2, each in the layout
its GEMM reads, tensorwise scales; the forward with fast accumulation), the head and attention
in bf16 as the default runs them. The casts and amaxes are left out, as the other elementwise
work is.

    python bench/matmul_floor.py [--shape SmolLM-1.7B] [--mbs 16] [--seq 2048] [--steps 5]
        [--fp8]

times the floor alone (bench_speed.py's "floor" row times it beside the other rows).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.speed.fp8.linear import scaled_mm  # noqa: E402
from picotron.speed.kernels.triton_loss import _accumulate as accumulate  # noqa: E402


def fp8_projection(weight, x, dy):
    """(forward, dgrad, wgrad): the three GEMMs of y = x W^T in FP8, as functions of nothing,
    on operands cast once here: W (O, I), x (N, I), dy (N, O), all bf16."""
    one = torch.ones((), device=weight.device)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    w8, w8_t = weight.to(e4m3), weight.t().contiguous().to(e4m3)          # (O, I), (I, O)
    x8, x8_t = x.to(e4m3), x.t().contiguous().to(e4m3)                    # (N, I), (I, N)
    dy8, dy8_t = dy.to(e5m2), dy.t().contiguous().to(e5m2)                # (N, O), (O, N)
    return (lambda: scaled_mm(x8, one, w8, one, torch.bfloat16, fast_accum=True),   # (N, O)
            lambda: scaled_mm(dy8, one, w8_t, one, torch.bfloat16),                 # (N, I)
            lambda: scaled_mm(dy8_t, one, x8_t, one, torch.bfloat16))               # (O, I)


def floor_runner(model_cfg, mbs, seq, device="cuda", chunk=4096, fp8=False):
    """(step function, None), as bench_speed's runners: step(i) queues one floor step and
    returns a float once the device is done. `fp8`: the projections' GEMMs in FP8."""
    C, L = model_cfg.hidden_size, model_cfg.num_hidden_layers
    H, K = model_cfg.num_attention_heads, model_cfg.num_key_value_heads
    D, Fw, V, N = C // H, model_cfg.intermediate_size, model_cfg.vocab_size, mbs * seq
    bf16 = dict(device=device, dtype=torch.bfloat16)

    def rand(*shape):
        return torch.randn(*shape, **bf16) * 0.02
    w_qkv, w_o, w_gu, w_down = rand(C + 2 * K * D, C), rand(C, C), rand(2 * Fw, C), rand(C, Fw)
    embedding = rand(V, C)
    x, h = rand(N, C), rand(N, Fw)
    # gradients that the model's elementwise kernels would write (SwiGLU's backward: d gu;
    # RoPE's backward: the packed d qkv), given once: the floor times no elementwise kernel
    dgu, dqkv = rand(N, 2 * Fw), rand(N, C + 2 * K * D)
    grad_embedding = torch.zeros(V, C, device=device, dtype=torch.float32)
    dy_c = rand(N, C)              # an output gradient of width C (o and down projections)
    if fp8:                        # each projection: (forward, dgrad, wgrad)
        qkv8, o8 = fp8_projection(w_qkv, x, dqkv), fp8_projection(w_o, x, dy_c)
        gu8, down8 = fp8_projection(w_gu, x, dgu), fp8_projection(w_down, h, dy_c)

    def attention_forward():
        qkv = qkv8[0]() if fp8 else x @ w_qkv.t()                    # (N, C + 2KD)
        q, k, v = (t.view(mbs, seq, -1, D).transpose(1, 2).detach().requires_grad_()
                   for t in qkv.split([C, K * D, K * D], dim=1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != K)
        return (q, k, v), out                                        # out (B, H, T, D)

    def step(i):
        saved = []
        for _ in range(L):                                           # forward
            qkv, out = attention_forward()
            attended = out.detach().transpose(1, 2).reshape(N, C)
            saved.append((qkv, out))
            if fp8:
                o8[0](), gu8[0](), down8[0]()
                continue
            attended @ w_o.t()
            x @ w_gu.t()
            h @ w_down.t()
        dx = torch.empty(N, C, **bf16)
        for start in range(0, N, chunk):                             # the tied head
            xs = x[start:start + chunk]
            logits = xs @ embedding.t()                              # (n, V); d logits reuses it
            torch.mm(logits, embedding, out=dx[start:start + chunk])
            accumulate(grad_embedding, logits.t(), xs)               # fp32 (V, C) += bf16 GEMM
        dy = dx
        for qkv, out in reversed(saved):                             # backward
            if fp8:            # d input and d W of each projection; SDPA's backward in bf16
                down8[1](), down8[2](), gu8[1](), gu8[2](), o8[1](), o8[2]()
                torch.autograd.grad(out, qkv, dy.view(mbs, seq, H, D).transpose(1, 2))
                dy = qkv8[1]()
                qkv8[2]()
                continue
            dy @ w_down                                              # d h (N, F)
            dy.t() @ h                                               # d W_down (C, F)
            dgu @ w_gu                                               # d x (N, C)
            dgu.t() @ x                                              # d W_gu (2F, C)
            dy @ w_o                                                 # d attended (N, C)
            dy.t() @ x                                               # d W_o (C, C)
            grad_out = dy.view(mbs, seq, H, D).transpose(1, 2)       # (B, H, T, D)
            torch.autograd.grad(out, qkv, grad_out)                  # d q, d k, d v
            dy = dqkv @ w_qkv                                        # d x (N, C)
            dqkv.t() @ x                                             # d W_qkv
        return float(dy[0, 0])                                       # waits for the device
    return step, None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="SmolLM-1.7B",
                   help="a model preset (configs/presets) (default: %(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--steps", type=int, default=5,
                   help="steps timed after one warm-up step (default: 5)")
    p.add_argument("--fp8", action="store_true", help="the projections' GEMMs in FP8, as the "
                   "default FP8 path runs them")
    return p


def main():
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: the floor times cuBLAS and cuDNN kernels: run it on a CUDA GPU")
    from picotron.config import ModelConfig
    from picotron.config.presets import resolve_model
    step, _ = floor_runner(ModelConfig(**resolve_model(args.shape)), args.mbs, args.seq,
                           fp8=args.fp8)
    step(0)                                   # warm-up: cuBLAS heuristics, Triton compile
    start = time.perf_counter()
    for i in range(args.steps):
        step(i + 1)                           # returns once the device is done
    seconds = (time.perf_counter() - start) / args.steps
    name = "floor fp8" if args.fp8 else "floor"
    print(f"{name} {args.shape} mbs {args.mbs} seq {args.seq}: {seconds * 1e3:.1f} ms/step, "
          f"{args.mbs * args.seq / seconds:,.0f} tokens/s")


if __name__ == "__main__":
    main()
