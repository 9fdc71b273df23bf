"""The CUDA-only fast paths against the readable PyTorch references, forward and backward.

Each module of both fast kinds, model.kernels = "liger" and "triton" (our kernels with fused
projections: the subclasses speed/kernels/swap.py swaps in), and the whole model with each. Skipped
without a GPU (CI has none; the Triton kernels' own tests run there in Triton's interpreter): run on
the device with `python -m pytest tests/test_kernels_gpu.py`. Inputs are fresh random draws at
SmolLM-360M's widths (C=960, I=2560, D=64, 15/5 heads), never zeros.

Tolerances: the reference and the fast path both compute in fp32 internally and round their
bf16 outputs once, so outputs differ by at most a bf16 rounding (2^-8 = 3.9e-3 relative) in
a fraction of the elements: relative L2 under 1e-2. Weight gradients sum over thousands of
tokens in a different order (and, for the loss, chunk by chunk): same bound. Each fast path
must also be as close to an fp64 reference as the bf16 reference is, within a factor of 2
(plus bf16's own step), so a fast path cannot be "close to the reference" by sharing its
error.
"""
import copy

import pytest
import torch
from torch.func import functional_call

from picotron.config import ModelConfig
from picotron.loss import causal_lm_loss
from picotron.model import Attention, LayerNorm, MLP, RMSNorm, rope_cos_sin
from picotron.attention import sdpa_attention
from picotron.speed.kernels.swap import fast_classes
from picotron.speed.loss import chunked_linear_cross_entropy
from picotron.speed.kernels.triton_loss import triton_linear_cross_entropy
from speed_helpers import build_with_speed

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
    """{textbook class: fast subclass} of each kind (model.kernels)."""
    if request.param == "liger":
        pytest.importorskip("liger_kernel")
    return fast_classes(request.param)


def randn(*shape):
    return torch.randn(*shape, device="cuda").bfloat16()


def as_function(module, fast_class=None, extra=()):
    """(x, *weights) -> module(x, *extra) with those weights, the module's class swapped for
    `fast_class` when given: so `check` compares the weights' gradients too."""
    module = copy.deepcopy(module)
    if fast_class is not None:
        module.__class__ = fast_class
    names = [n for n, _ in module.named_parameters()]
    return lambda x, *ws: functional_call(module, dict(zip(names, ws)), (x, *extra))


CFG = ModelConfig(hidden_size=960, intermediate_size=2560, num_attention_heads=15,
                  num_key_value_heads=5)


def test_norms(fast):
    """Every norm the kind has a kernel for (liger: RMSNorm; LayerNorm stays F.layer_norm)."""
    for norm in [n for n in (RMSNorm, LayerNorm) if n in fast]:
        module = norm(960, 1e-5).cuda()
        w = (1 + 0.1 * torch.randn(960, device="cuda")).bfloat16()
        check(as_function(module, fast[norm]), as_function(module), [randn(4, 512, 960), w],
              [randn(4, 512, 960)])


@pytest.mark.parametrize("zigzag", [False, True])
def test_attention(fast, zigzag):
    """The attention block (q, k, v projected from x, q and k rotated, SDPA, o) at 360M's
    head counts (15 / 5 kv heads, D 64); positions 0..T-1, or two distant chunks as a
    context-parallel rank holds them."""
    B, T = 2, 256
    pos = torch.arange(T, device="cuda")
    if zigzag:
        pos = torch.cat([pos[:T // 2], pos[T // 2:] + 1000])
    pos = pos.expand(B, T)
    cos, sin = rope_cos_sin(pos, 64, 10000.0, torch.bfloat16)
    module = Attention(CFG, sdpa_attention).cuda()
    ws = [0.03 * randn(*p.shape) for p in module.parameters()]
    check(as_function(module, fast[Attention], (cos, sin)),
          as_function(module, None, (cos, sin)), [randn(B, T, 960)] + ws,
          [randn(B, T, 960)])


def test_mlp(fast):
    module = MLP(CFG).cuda()
    ws = [0.03 * randn(*p.shape) for p in module.parameters()]
    check(as_function(module, fast[MLP]), as_function(module), [randn(4, 512, 960)] + ws,
          [randn(4, 512, 960)])


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
    if "liger" in (kernels, fused_loss):      # an optional package; ours always run
        pytest.importorskip("liger_kernel")
    cfg = dict(vocab_size=4096, hidden_size=960, intermediate_size=2560, num_hidden_layers=4,
               num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True)
    ids = torch.randint(0, 4096, (2, 512), device="cuda")
    out = {}
    for name, args in (("ref", ("torch", "none", None, "none")),
                       ("fast", (kernels, checkpointing, None, fused_loss))):
        model, loss_fn = build_with_speed(cfg, *args, device="cuda", dtype=torch.bfloat16,
                                          seed=1)
        loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert abs(out["fast"][0] - out["ref"][0]) < 1e-2 * out["ref"][0]
    for n, g in out["ref"][1].items():
        assert rel_err(out["fast"][1][n], g) < 2e-2, (n, rel_err(out["fast"][1][n], g))
