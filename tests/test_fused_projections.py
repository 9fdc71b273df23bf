"""Fused projections (picotron/speed/kernels/fused_linear.py) and the packed SwiGLU kernel
(picotron/speed/kernels/triton_swiglu.py) against their readable references, forward and backward.

Runs on CPU (Triton's interpreter, set by conftest.py, at small sizes: C = 36, an odd I = 37
and an I that spans two column blocks with a tail) and, where there is a GPU, at
SmolLM-360M's widths: x (16, 2048, 960), q/k/v outputs 960/320/320, I = 2560.

Tolerances (relative L2 error over the whole tensor):
- fp32: both sides compute in fp32 and differ only in summation order (one GEMM over
  K = O_q + O_k + O_v against three summed GEMMs; sigmoid and products in a different op
  order); fp32's unit roundoff is 6e-8, and sums of up to 32768 terms stay well under 1e-5.
- bf16, as in tests/test_kernels_gpu.py: the outputs differ by at most one bf16 rounding
  (2^-8 = 3.9e-3 relative) in a fraction of the elements, so under 1e-2; and the fast path
  must be as close to an fp64 reference as the bf16 reference is, within 2x plus bf16's own
  step (4e-3), so it cannot pass by sharing the reference's error.
"""
import pytest
import torch

from picotron.speed.kernels.fused_linear import fused_linear, fused_linear_reference, stacked
from picotron.speed.recompute import checkpointed
from picotron.speed.kernels.triton_swiglu import (swiglu_linear, swiglu_linear_reference,
                                                  swiglu_packed, swiglu_packed_reference)

CUDA = torch.cuda.is_available()
# Triton kernels run on CPU tensors only in the interpreter (conftest.py sets it when there is
# no GPU); with a GPU, the small cases run there instead.
SMALL = "cuda" if CUDA else "cpu"


def on_cuda(*case):
    return pytest.param("cuda", *case, marks=pytest.mark.skipif(not CUDA, reason="needs a GPU"))


# the small cases run in the interpreter on CPU, and on the GPU where there is one (Triton
# cannot take CPU tensors once it compiles for a GPU)
SMALL = "cuda" if CUDA else "cpu"
# (device, x shape, output sizes of the fused weights)
LINEAR_CASES = [(SMALL, (2, 5, 36), (36, 12, 12)), (SMALL, (2, 5, 36), (24, 24)),
                (SMALL, (7, 36), (5,)),
                on_cuda((16, 2048, 960), (960, 320, 320)), on_cuda((16, 2048, 960), (2560, 2560))]
# (device, gu shape): I = 24, odd 37, 600 = two column blocks of 512 with a tail; 360M's 2560
SWIGLU_CASES = [(SMALL, (2, 5, 48)), (SMALL, (2, 5, 74)), (SMALL, (1, 3, 1200)),
                on_cuda((16, 2048, 5120))]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(fn, inputs, dy):
    """fn's output and the gradients of <fn(inputs), dy> w.r.t. every input."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(dy)
    return [out.detach()] + [x.grad for x in inputs]


def check(fast, ref, inputs, dy):
    got, want = run(fast, inputs, dy), run(ref, inputs, dy)
    exact = run(ref, [x.double() for x in inputs], dy.double())
    for i, (g, w, e) in enumerate(zip(got, want, exact)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, g.shape, w.shape)
        assert torch.isfinite(g).all(), i
        if g.dtype == torch.float32:
            assert rel_err(g, w) < 1e-5, (i, rel_err(g, w))
            assert rel_err(g, e) < 1e-5, (i, rel_err(g, e))
        else:
            assert rel_err(g, w) < 1e-2, (i, rel_err(g, w))
            assert rel_err(g, e) < 2 * rel_err(w, e) + 4e-3, (i, rel_err(g, e), rel_err(w, e))


def randn(shape, device, dtype, std=1.0):
    return (std * torch.randn(shape, device=device)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device, shape, outs", LINEAR_CASES)
def test_fused_linear(device, shape, outs, dtype):
    """y, dx and every dW_i against one F.linear per weight, concatenated."""
    torch.manual_seed(0)
    C = shape[-1]
    x = randn(shape, device, dtype)
    ws = [randn((o, C), device, dtype, std=C ** -0.5) for o in outs]
    dy = randn((*shape[:-1], sum(outs)), device, dtype)
    check(lambda x, *ws: fused_linear(x, ws), lambda x, *ws: fused_linear_reference(x, ws),
          [x, *ws], dy)


def test_fused_linear_needs_input_grad():
    """Only the inputs that ask for a gradient get one: a frozen weight and an x without grad."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 36)
    ws = [torch.randn(o, 36, requires_grad=o != 12) for o in (36, 12, 20)]
    y = fused_linear(x, ws)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert ws[1].grad is None
    want = dy.reshape(-1, 68).t() @ x.reshape(-1, 36)          # (O, C), rows split 36/12/20
    torch.testing.assert_close(ws[0].grad, want[:36])
    torch.testing.assert_close(ws[2].grad, want[48:])
    x.requires_grad_()                                          # and x alone
    fused_linear(x, [w.detach() for w in ws]).backward(dy)
    torch.testing.assert_close(x.grad, dy @ torch.cat([w.detach() for w in ws]))


def test_stacked_takes_adjacent_weights_in_place():
    """Weights back to back in one buffer, in order (as GradBuckets lays out q/k/v): one view,
    no copy, and fused_linear's output and gradients bitwise those of concatenated copies.
    Another order, a gap or another buffer: a copy, the same values."""
    torch.manual_seed(0)
    flat = torch.randn(60 * 36, device=SMALL)
    ws = [flat[:1296].view(36, 36), flat[1296:1728].view(12, 36), flat[1728:].view(12, 36)]
    w = stacked(ws)
    assert w.data_ptr() == ws[0].data_ptr() and torch.equal(w, torch.cat(ws))
    for other in (ws[::-1], [ws[0], ws[2]], [ws[0], ws[1].clone(), ws[2]]):
        w = stacked(other)
        assert w.data_ptr() != other[0].data_ptr() and torch.equal(w, torch.cat(other))
    params = [torch.nn.Parameter(torch.empty(0, device=SMALL)) for _ in ws]
    for p, w in zip(params, ws):
        p.data = w                                   # as GradBuckets sets them
    x, dy = torch.randn(2, 5, 36, device=SMALL), torch.randn(2, 5, 60, device=SMALL)
    got = run(lambda x, *w: fused_linear(x, params), [x], dy)
    got += [p.grad for p in params]
    want = run(lambda x, *w: fused_linear(x, w), [x] + [w.clone() for w in ws], dy)
    for g, r in zip(got, want):
        assert torch.equal(g, r)


def test_fused_linear_saves_x_and_weights_only():
    """Backward keeps x and the individual weights, never their (O, C) concatenation."""
    x = torch.randn(2, 5, 36, requires_grad=True)
    ws = [torch.randn(o, 36, requires_grad=True) for o in (36, 12, 12)]
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused_linear(x, ws)
    assert sum(t.numel() for t in saved) == x.numel() + sum(w.numel() for w in ws)
    assert all(t.shape != (60, 36) for t in saved)
    y.sum().backward()                                          # and backward still works
    assert all(w.grad is not None for w in ws)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device, shape", SWIGLU_CASES)
def test_swiglu_packed(device, shape, dtype, inplace):
    """h and d(gu) against model.py's swiglu on the two halves. `inplace`: gu is an
    intermediate (`* 1`, as fused_linear's output is), so backward overwrites it; otherwise a
    leaf, which backward must leave alone."""
    torch.manual_seed(0)
    gu = randn(shape, device, dtype, std=2.0)
    dh = randn((*shape[:-1], shape[-1] // 2), device, dtype)
    fast = (lambda gu: swiglu_packed(gu * 1)) if inplace else swiglu_packed
    check(fast, swiglu_packed_reference, [gu], dh)
    leaf = gu.clone().requires_grad_()
    swiglu_packed(leaf).backward(dh)
    assert torch.equal(leaf.detach(), gu)                       # a leaf is never overwritten


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device, shape", SWIGLU_CASES)
def test_swiglu_linear(device, shape, dtype, inplace):
    """swiglu_linear(gu, w_down) recomputes h = swiglu(gu) in backward: its output and the
    gradients of gu and w_down are bitwise those of swiglu_packed then F.linear, which keeps
    h (same kernels on the same inputs; the recomputed h is the forward's to the bit)."""
    torch.manual_seed(0)
    i, o = shape[-1] // 2, 40
    gu = randn(shape, device, dtype, std=2.0)
    w = randn((o, i), device, dtype, std=i ** -0.5)
    dy = randn((*shape[:-1], o), device, dtype)
    wrap = (lambda f: lambda gu, w: f(gu * 1, w)) if inplace else (lambda f: f)
    got = run(wrap(swiglu_linear), [gu, w], dy)
    want = run(wrap(swiglu_linear_reference), [gu, w], dy)
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    # and the gradient of w alone (gu needs none): h from the forward kernel instead
    w2 = w.clone().requires_grad_()
    swiglu_linear(gu, w2).backward(dy)
    assert torch.equal(w2.grad, want[2])


def test_swiglu_linear_keeps_gu_and_weight_only():
    """What makes it worth having: backward keeps gu and w_down, not the (N, I) SwiGLU output
    that F.linear would save (18-20% of a layer's activations at SmolLM's widths)."""
    gu = torch.randn(2, 5, 48, device=SMALL, requires_grad=True)
    w = torch.randn(30, 24, device=SMALL, requires_grad=True)
    for fn, extra in ((swiglu_linear, 0), (swiglu_linear_reference, 2 * 5 * 24)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            y = fn(gu * 1, w)
        assert sum(t.numel() for t in saved) == gu.numel() + w.numel() + extra, fn
        y.sum().backward()


def test_swiglu_inplace_is_guarded():
    """After backward overwrites gu, whoever would still read it through autograd gets
    PyTorch's in-place error, not gradients posing as activations."""
    gu = torch.randn(2, 5, 48, device=SMALL, requires_grad=True)
    h = swiglu_packed(gu * 1)
    h.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()                                      # a second pass over gu
    mid = gu * 1
    other = mid.sin()                  # saves mid; made first, so its backward runs after ours
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (other.sum() + swiglu_packed(mid).sum()).backward()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_mlp_under_activation_checkpointing(mode):
    """down(swiglu_packed(fused_linear(x, [gate, up]))) recomputed in backward gives bitwise
    the output and gradients of no checkpointing, and matches the unfused reference."""
    torch.manual_seed(0)
    x0, wd = torch.randn(2, 5, 36, device=SMALL), torch.randn(36, 24, device=SMALL) / 24 ** 0.5
    wg, wu = torch.randn(24, 36, device=SMALL) / 6, torch.randn(24, 36, device=SMALL) / 6

    def mlp(x, wg, wu, wd, fused=True):
        if fused:
            h = swiglu_packed(fused_linear(x, [wg, wu]))
        else:
            h = swiglu_packed_reference(torch.cat([x @ wg.t(), x @ wu.t()], -1))
        return h @ wd.t()

    def grads(recompute, fused=True):
        ins = [t.clone().requires_grad_() for t in (x0, wg, wu, wd)]
        fn = lambda x: mlp(x, *ins[1:], fused=fused)            # noqa: E731
        y = checkpointed(fn, recompute, ins[0]) if recompute else fn(ins[0])
        y.pow(2).sum().backward()
        return [y.detach()] + [t.grad for t in ins]
    for got, want, ref in zip(grads(mode), grads(None), grads(None, fused=False)):
        assert torch.equal(got, want)
        assert rel_err(got, ref) < 1e-5
