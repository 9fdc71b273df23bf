"""Our Triton RMSNorm and LayerNorm (picotron/speed/kernels/triton_norms.py) against the references
in model.py: the output, dx and dweight, in the input dtype and in float64.

Runs on CUDA where there is a GPU, else on CPU through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1), with small shapes there: C = 36, 100, 576, 960 (not powers of two), and
enough rows that each backward program walks several row blocks and meets a ragged last one
(the CPU grid is 4 programs; (5, 13, 576) is 17 blocks of 4 rows).

Tolerances. The "float64" oracle is the reference run on float64 inputs; model.py's references
upcast with .float(), so it computes in fp32 but rounds nothing to bf16: ~1e-7 relative.
- fp32 inputs: the kernels and the reference differ only in fp32 summation order: 1e-5
  relative L2, and 1e-5 of (|exact| + rms(exact)) per element.
- bf16 inputs (as tests/test_kernels_gpu.py): both compute in fp32 and round their bf16
  results once or twice (2^-8 relative each), so relative L2 to the bf16 reference < 1e-2, and
  to the oracle within 2x the bf16 reference's own error + 4e-3, so agreeing with the reference
  cannot come from sharing its error. Per element, 2^-6 of (|exact| + rms(exact)) (a few
  bf16 steps). Triton's interpreter rounds fp32 -> bf16 towards zero (GPUs round to nearest),
  so on CPU each rounding can cost a whole bf16 step: still inside these bounds.
The per-element bounds look at every element, so a row or tile left unwritten (torch.empty
holds whatever was there) cannot hide inside a norm.
"""
import pytest
import torch

from picotron.model import layer_norm, rms_norm
from picotron.speed.kernels import triton_norms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 5, 36), (4, 33, 100), (5, 13, 576), (2, 7, 960)]
if DEVICE == "cuda":
    SHAPES += [(16, 2048, 960), (4, 2048, 2048), (2, 1024, 8192)]
NORMS = {"rms_norm": (triton_norms.rms_norm, rms_norm),
         "layer_norm": (triton_norms.layer_norm, layer_norm)}
EPS = 1e-5


def run(fn, x, w, dy):
    """fn's output and the gradients of <fn(x, w), dy> w.r.t. x and w (x keeps its strides)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, EPS)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compare(name, g, r, e, bf16):
    """One result of the kernel (g), of the reference (r) and of the float64 oracle (e)."""
    assert g.shape == r.shape and g.dtype == r.dtype, (name, g.dtype, r.dtype)
    assert torch.isfinite(g).all(), name
    bound = 2 ** -6 if bf16 else 1e-5
    worst = ((g.double() - e).abs() / (e.abs() + e.pow(2).mean().sqrt())).max().item()
    assert worst < bound, (name, worst)
    if bf16:
        assert rel_err(g, r) < 1e-2, (name, rel_err(g, r))
        assert rel_err(g, e) < 2 * rel_err(r, e) + 4e-3, (name, rel_err(g, e), rel_err(r, e))
    else:
        assert rel_err(g, e) < 1e-5, (name, rel_err(g, e))


def check(fast, ref, x, w, dy, bf16):
    got, want = run(fast, x, w, dy), run(ref, x, w, dy)
    exact = run(ref, x.double(), w.double(), dy.double())
    for name, g, r, e in zip(("y", "dx", "dw"), got, want, exact):
        compare(name, g, r, e, bf16)


def inputs(shape, x_dtype, w_dtype):
    """Fresh random draws, never zeros: x with a row-dependent offset and scale (what a
    residual stream looks like, and what makes LayerNorm's mean matter), a gain near 1."""
    x = torch.randn(shape, device=DEVICE) * (1 + torch.rand(shape[:-1] + (1,), device=DEVICE))
    x = x + torch.randn(shape[:-1] + (1,), device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    return x.to(x_dtype), w.to(w_dtype), torch.randn(shape, device=DEVICE).to(x_dtype)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(norm, dtype, shape):
    torch.manual_seed(0)
    check(*NORMS[norm], *inputs(shape, dtype, dtype), bf16=dtype == torch.bfloat16)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_mixed_dtypes(norm, x_dtype, w_dtype):
    """Weight and input in different dtypes: RMSNorm's output takes the promoted dtype
    (fp32), LayerNorm's the input's; dweight comes back in the weight's dtype."""
    torch.manual_seed(0)
    check(*NORMS[norm], *inputs((4, 33, 100), x_dtype, w_dtype), bf16=True)


@pytest.mark.parametrize("norm", NORMS)
def test_non_contiguous(norm):
    """x and dy as (T, B, C) transposes of (B, T, C) tensors: no (N, C) view of them exists,
    so the kernels get a copy; column slices [..., :C] of wider tensors are read in place."""
    torch.manual_seed(0)
    x, w, dy = inputs((5, 13, 100), torch.bfloat16, torch.bfloat16)
    x_t, dy_t = x.transpose(0, 1), dy.transpose(0, 1)
    assert not x_t.is_contiguous() and not dy_t.is_contiguous()
    check(*NORMS[norm], x_t, w, dy_t, bf16=True)
    x_s, dy_s = (torch.randn(5, 13, 160, device=DEVICE).bfloat16()[..., :100] for _ in "xy")
    assert x_s.reshape(-1, 100).stride(0) == 160   # an (N, C) view with row stride 160
    check(*NORMS[norm], x_s, w, dy_s, bf16=True)


@pytest.mark.parametrize("norm", NORMS)
def test_backward_leaves_dy_alone(norm):
    """dx is a fresh tensor: the incoming gradient (here also kept by the caller) is unchanged."""
    torch.manual_seed(0)
    x, w, dy = inputs((4, 33, 100), torch.bfloat16, torch.bfloat16)
    before = dy.clone()
    _, dx, _ = run(NORMS[norm][0], x, w, dy)
    assert torch.equal(dy, before)
    assert dx.data_ptr() != dy.data_ptr()



ADD_NORMS = {"rms_norm": triton_norms.add_rms_norm, "layer_norm": triton_norms.add_layer_norm}


def run_residual(fn, x, delta, w, ds, dy):
    """(s, y) = fn(x, delta, w) and the gradients of <s, ds> + <y, dy> w.r.t. x, delta and w."""
    x, delta, w = (t.detach().requires_grad_() for t in (x, delta, w))
    s, y = fn(x, delta, w, EPS)
    torch.autograd.backward((s, y), (ds, dy))
    return s.detach(), y.detach(), x.grad, delta.grad, w.grad


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_residual_form_matches_the_add_then_the_reference(norm, dtype, shape):
    """add_rms_norm / add_layer_norm against `s = x + delta` then the reference norm: s, the
    norm, the gradient of x and of delta (the residual's ds plus the norm's, one tensor for
    both) and of the weight, at the tolerances above."""
    torch.manual_seed(0)
    x, w, dy = inputs(shape, dtype, dtype)
    delta, ds = (torch.randn(shape, device=DEVICE).to(dtype) for _ in range(2))
    ref = NORMS[norm][1]

    def textbook(x, delta, w, eps):
        s = x + delta
        return s, ref(s, w, eps)
    got = run_residual(ADD_NORMS[norm], x, delta, w, ds, dy)
    want = run_residual(textbook, x, delta, w, ds, dy)
    exact = run_residual(textbook, *(t.double() for t in (x, delta, w, ds, dy)))
    for name, g, r, e in zip(("s", "y", "dx", "ddelta", "dw"), got, want, exact):
        compare(name, g, r, e, bf16=dtype == torch.bfloat16)
    assert torch.equal(got[2], got[3])
