"""picotron/speed/kernels/triton_rope.py against the reference: split the packed projection,
model.apply_rope.

Runs on a GPU, and on CPU in Triton's interpreter (tests/conftest.py). Positions are shuffled
(context parallelism hands a rank two distant chunks), head dims include 6 (D/2 = 3, not a
power of two: the masked path) and GQA, MQA and MHA head counts.

Tolerances: fp32 does the reference's arithmetic (two products and a sum per element), 1e-6
relative. bf16: the reference rounds after each op, the kernel once, so both are compared with
an fp64 reference and the kernel must be no further from it than the bf16 reference is (x1.5
plus bf16's half step 2^-9; on CPU plus one bf16 step: the interpreter truncates, see
tests/test_triton_adamw.py).
"""
import pytest
import torch

from tiny import import_triton
import_triton()
from picotron.model import apply_rope, rope_cos_sin  # noqa: E402
from picotron.speed.kernels.triton_rope import qkv_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_STEP = 2 ** -7 if DEVICE == "cpu" else 0.0
SHAPES = ([(2, 5, 6, 2, 6), (1, 7, 4, 4, 8), (2, 3, 5, 1, 8)] if DEVICE == "cpu"
          else [(16, 2048, 15, 5, 64), (4, 2048, 32, 32, 64)])       # B, T, H, K, D


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(qkv, cos, sin, H, K):
    B, T, _ = qkv.shape
    D = cos.shape[-1]
    q, k, v = (t.reshape(B, T, -1, D).transpose(1, 2) for t in qkv.split([H * D, K * D, K * D], -1))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def run(fn, qkv, cos, sin, H, K, grads):
    qkv = qkv.detach().clone().requires_grad_()
    outs = fn(qkv, cos, sin, H, K)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [qkv.grad]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(shape, dtype):
    B, T, H, K, D = shape
    g = torch.Generator(device=DEVICE).manual_seed(sum(shape))
    positions = torch.stack([torch.randperm(4 * T, generator=g, device=DEVICE)[:T]
                             for _ in range(B)])
    cos, sin = rope_cos_sin(positions, D, 10000.0, dtype)
    qkv = torch.randn(B, T, (H + 2 * K) * D, generator=g, device=DEVICE).to(dtype)
    grads = [torch.randn(B, n, T, D, generator=g, device=DEVICE).to(dtype) for n in (H, K, K)]
    got = run(qkv_rope, qkv, cos, sin, H, K, grads)
    want = run(reference, qkv, cos, sin, H, K, grads)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.isfinite(a).all(), i
    if dtype == torch.float32:
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel(a, b) < 1e-6, (i, rel(a, b))
        return
    exact = run(reference, qkv.double(), cos.double(), sin.double(), H, K,
                [x.double() for x in grads])
    for i, (a, b, e) in enumerate(zip(got, want, exact)):
        assert rel(a, e) < 1.5 * rel(b, e) + 2 ** -9 + BF16_STEP, (i, rel(a, e), rel(b, e))


def test_outputs_are_fresh_contiguous_tensors():
    """q, k, v must not be views of the packed projection (it would stay alive in memory)."""
    B, T, H, K, D = SHAPES[0]
    qkv = torch.randn(B, T, (H + 2 * K) * D, device=DEVICE)
    cos, sin = rope_cos_sin(torch.arange(T, device=DEVICE).expand(B, T), D, 10000.0, qkv.dtype)
    for t in qkv_rope(qkv, cos, sin, H, K):
        assert t.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
        assert t.transpose(1, 2).is_contiguous()
