"""The CUDA-only fast paths against the readable PyTorch references, forward and backward.

Skipped without a GPU (CI has none): run on the device with `python -m pytest
tests/test_kernels_gpu.py`. Inputs are fresh random draws at SmolLM-360M's widths (C=960,
I=2560, D=64, 15/5 heads), never zeros.

Tolerances: the reference and the fast path both compute in fp32 internally and round their
bf16 outputs once, so outputs differ by at most a bf16 rounding (2^-8 = 3.9e-3 relative) in
a fraction of the elements: relative L2 under 1e-2. Weight gradients sum over thousands of
tokens in a different order (and, for the loss, chunk by chunk): same bound. Each fast path
must also be as close to an fp64 reference as the bf16 reference is, within a factor of 2
(plus bf16's own step), so a fast path cannot be "close to the reference" by sharing its
error.
"""
import pytest
import torch

from picotron.config import ModelConfig
from picotron.model import (TORCH_KERNELS, Decoder, causal_lm_loss, materialize, rope_cos_sin,
                            sdpa_attention)
from picotron.ops.loss import LinearCrossEntropy, chunked_linear_cross_entropy

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


@pytest.fixture(scope="module")
def liger():
    pytest.importorskip("liger_kernel")
    from picotron.ops.liger import liger_kernels
    return liger_kernels()


def randn(*shape):
    return torch.randn(*shape, device="cuda").bfloat16()


def test_rms_norm(liger):
    x, w = randn(4, 512, 960), (1 + 0.1 * torch.randn(960, device="cuda")).bfloat16()
    check(lambda x, w: liger.rms_norm(x, w, 1e-5), lambda x, w: TORCH_KERNELS.rms_norm(x, w, 1e-5),
          [x, w], [randn(4, 512, 960)])


@pytest.mark.parametrize("zigzag", [False, True])
def test_rope(liger, zigzag):
    """q, k as the model makes them: (B, T, H, D) projections viewed as (B, H, T, D); positions
    0..T-1, or two distant chunks as a context-parallel rank holds them."""
    B, T = 2, 256
    pos = torch.arange(T, device="cuda")
    if zigzag:
        pos = torch.cat([pos[:T // 2], pos[T // 2:] + 1000])
    cos, sin = rope_cos_sin(pos.expand(B, T), 64, 10000.0, torch.bfloat16)
    q, k = randn(B, T, 15, 64).transpose(1, 2), randn(B, T, 5, 64).transpose(1, 2)
    dq, dk = randn(B, 15, T, 64), randn(B, 5, T, 64)
    # `+ 0`: a non-leaf with the same strides, like the projection output (liger rotates in place)
    check(lambda q, k: liger.rope(q + 0, k + 0, cos, sin),
          lambda q, k: TORCH_KERNELS.rope(q, k, cos, sin), [q, k], [dq, dk])


def test_swiglu(liger):
    check(liger.swiglu, TORCH_KERNELS.swiglu, [randn(4, 512, 2560), randn(4, 512, 2560)],
          [randn(4, 512, 2560)])


@pytest.mark.parametrize("impl", ["chunked", "liger"])
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
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        return liger_fused_linear_cross_entropy(h, w, t, accum_dtype=torch.float32)

    def ref(h, w):
        return causal_lm_loss((h @ w.t())[None], t[None])
    check(fused, ref, [h, w], [torch.ones((), device="cuda")])


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_model_with_liger_matches_torch(liger, checkpointing):
    """A 4-layer model at 360M's widths, bf16, the same weights: logits and every gradient of
    the kernels="liger" + fused-loss path against the reference path."""
    cfg = dict(vocab_size=4096, hidden_size=960, intermediate_size=2560, num_hidden_layers=4,
               num_attention_heads=15, num_key_value_heads=5)
    ids = torch.randint(0, 4096, (2, 512), device="cuda")
    out = {}
    for name, kernels, ckpt in (("ref", "torch", "none"), ("fast", "liger", checkpointing)):
        with torch.device("meta"):
            model = Decoder(ModelConfig(**cfg, kernels=kernels, tie_word_embeddings=True),
                            sdpa_attention, ckpt)
        materialize(model, 1, "cuda", torch.bfloat16)
        if name == "ref":
            loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
        else:
            loss = LinearCrossEntropy(model, "liger")(model(ids[:, :-1], head=False), ids[:, 1:])
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert abs(out["fast"][0] - out["ref"][0]) < 1e-2 * out["ref"][0]
    for n, g in out["ref"][1].items():
        assert rel_err(out["fast"][1][n], g) < 2e-2, (n, rel_err(out["fast"][1][n], g))
