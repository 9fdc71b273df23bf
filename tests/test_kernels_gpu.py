"""The CUDA-only fast paths against the readable PyTorch references, forward and backward.

Each op of both fast namespaces, model.kernels = "liger" and "triton" (our kernels with fused
projections), and the whole model with each. Skipped without a GPU (CI has none; the Triton
kernels' own tests run there in Triton's interpreter): run on the device with `python -m
pytest tests/test_kernels_gpu.py`. Inputs are fresh random draws at SmolLM-360M's widths
(C=960, I=2560, D=64, 15/5 heads), never zeros.

Tolerances: the reference and the fast path both compute in fp32 internally and round their
bf16 outputs once, so outputs differ by at most a bf16 rounding (2^-8 = 3.9e-3 relative) in
a fraction of the elements: relative L2 under 1e-2. Weight gradients sum over thousands of
tokens in a different order (and, for the loss, chunk by chunk): same bound. Each fast path
must also be as close to an fp64 reference as the bf16 reference is, within a factor of 2
(plus bf16's own step), so a fast path cannot be "close to the reference" by sharing its
error.
"""
import types

import pytest
import torch
import torch.nn.functional as F

from picotron.config import ModelConfig
from picotron.attention import sdpa_attention
from picotron.model import (TORCH_KERNELS, Decoder, causal_lm_loss, materialize,
                            resolve_kernels, rope_cos_sin)
from picotron.ops.loss import LinearCrossEntropy, chunked_linear_cross_entropy
from picotron.ops.triton_loss import triton_linear_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = 1e-2


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(fn, inputs, dy):
    """fn's output and the gradients of <fn(inputs), dy> w.r.t. every input."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, dy)
    return [o.detach() for o in out] + [x.grad for x in inputs]


def check(fast, ref, inputs, dy):
    got, want = run(fast, inputs, dy), run(ref, inputs, dy)
    exact = run(ref, [x.double() for x in inputs], [d.double() for d in dy])
    for i, (g, w, e) in enumerate(zip(got, want, exact)):
        assert torch.isfinite(g).all(), i
        assert rel_err(g, w) < TOL, (i, rel_err(g, w))
        assert rel_err(g, e) < 2 * rel_err(w, e) + 4e-3, (i, rel_err(g, e), rel_err(w, e))


@pytest.fixture(scope="module", params=["liger", "triton"])
def fast(request):
    """Each fast op namespace (model.kernels), against TORCH_KERNELS."""
    if request.param == "liger":
        pytest.importorskip("liger_kernel")
    return resolve_kernels(request.param)


def randn(*shape):
    return torch.randn(*shape, device="cuda").bfloat16()


class Linear:
    """A projection made of a given weight tensor, so that its gradient can be checked."""
    def __init__(self, weight):
        self.weight = weight

    def __call__(self, x):
        return F.linear(x, self.weight)


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_norms(fast, norm):
    x, w = randn(4, 512, 960), (1 + 0.1 * torch.randn(960, device="cuda")).bfloat16()
    check(lambda x, w: getattr(fast, norm)(x, w, 1e-5),
          lambda x, w: getattr(TORCH_KERNELS, norm)(x, w, 1e-5), [x, w], [randn(4, 512, 960)])


@pytest.mark.parametrize("zigzag", [False, True])
def test_qkv_rope(fast, zigzag):
    """q, k, v projected from x and q, k rotated, at 360M's head counts (15 / 5 kv heads, D 64);
    positions 0..T-1, or two distant chunks as a context-parallel rank holds them."""
    B, T = 2, 256
    pos = torch.arange(T, device="cuda")
    if zigzag:
        pos = torch.cat([pos[:T // 2], pos[T // 2:] + 1000])
    cos, sin = rope_cos_sin(pos.expand(B, T), 64, 10000.0, torch.bfloat16)
    ws = [0.03 * randn(n, 960) for n in (960, 320, 320)]

    def via(kernels):
        def f(x, wq, wk, wv):
            attn = types.SimpleNamespace(head_dim=64, q_proj=Linear(wq), k_proj=Linear(wk),
                                         v_proj=Linear(wv))
            return kernels.qkv_rope(x, attn, cos, sin)
        return f
    check(via(fast), via(TORCH_KERNELS), [randn(B, T, 960)] + ws,
          [randn(B, 15, T, 64), randn(B, 5, T, 64), randn(B, 5, T, 64)])


def test_swiglu_in(fast):
    def via(kernels):
        return lambda x, wg, wu: kernels.swiglu_in(
            x, types.SimpleNamespace(gate_proj=Linear(wg), up_proj=Linear(wu)))
    check(via(fast), via(TORCH_KERNELS), [randn(4, 512, 960), 0.03 * randn(2560, 960),
                                          0.03 * randn(2560, 960)], [randn(4, 512, 2560)])


@pytest.mark.parametrize("impl", ["chunked", "liger", "triton"])
def test_fused_loss(impl):
    """hidden (N, C) and head (V, C) in bf16 against the full-logits fp32 loss."""
    if impl == "liger":
        pytest.importorskip("liger_kernel")
    N, C, V = 4096, 960, 8192
    h, w = randn(N, C), (0.05 * torch.randn(V, C, device="cuda")).bfloat16()
    t = torch.randint(0, V, (N,), device="cuda")

    def fused(h, w):
        if impl == "chunked":
            return chunked_linear_cross_entropy(h, w, t)
        if impl == "triton":
            return triton_linear_cross_entropy(h, w, t, 1024)
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        return liger_fused_linear_cross_entropy(h, w, t, accum_dtype=torch.float32)

    def ref(h, w):
        return causal_lm_loss((h @ w.t())[None], t[None])
    check(fused, ref, [h, w], [torch.ones((), device="cuda")])


@pytest.mark.parametrize("kernels,checkpointing,fused_loss", [
    ("liger", "none", "liger"), ("liger", "full", "liger"), ("triton", "none", "liger"),
    ("triton", "full", "liger"), ("triton", "none", "triton"), ("triton", "full", "triton"),
    ("triton", "selective", "triton")])
def test_model_with_fast_kernels_matches_torch(kernels, checkpointing, fused_loss):
    """A 4-layer model at 360M's widths, bf16, the same weights: logits and every gradient of
    the fast kernels + fused-loss path (liger's or ours) against the reference path."""
    pytest.importorskip("liger_kernel")
    cfg = dict(vocab_size=4096, hidden_size=960, intermediate_size=2560, num_hidden_layers=4,
               num_attention_heads=15, num_key_value_heads=5)
    ids = torch.randint(0, 4096, (2, 512), device="cuda")
    out = {}
    for name, ops, ckpt in (("ref", "torch", "none"), ("fast", kernels, checkpointing)):
        with torch.device("meta"):
            model = Decoder(ModelConfig(**cfg, kernels=ops, tie_word_embeddings=True),
                            sdpa_attention, ckpt)
        materialize(model, 1, "cuda", torch.bfloat16)
        if name == "ref":
            loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
        else:
            loss = LinearCrossEntropy(model, fused_loss)(model(ids[:, :-1], head=False), ids[:, 1:])
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert abs(out["fast"][0] - out["ref"][0]) < 1e-2 * out["ref"][0]
    for n, g in out["ref"][1].items():
        assert rel_err(out["fast"][1][n], g) < 2e-2, (n, rel_err(out["fast"][1][n], g))
