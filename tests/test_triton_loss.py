"""picotron/speed/kernels/triton_loss.py (training.fused_loss="triton") against torch's
cross_entropy on the full logits: loss, gradient of the hidden states and of the head weight.

Runs on a GPU, and on CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) with
small shapes. The row pass is forced to a 128-column block so that each pass loops over several
blocks plus a ragged tail (V = 300), as V = 49152 does in 32768-column blocks on the GPU.

Tolerances. fp32 inputs: the same math in another summation order (online softmax, per-chunk
fp32 accumulation of the weight gradient), ~1e-7 relative per sum: 1e-5. bf16 inputs (GPU
only, the interpreter truncates its bf16 roundings): the logits and the logit gradients are
bf16 here as in liger-kernel and "chunked", the reference keeps them fp32: one bf16 rounding,
2^-9 relative, of each logit and each gradient element, so 1e-2 on the gradients and 2e-3 on the
loss (a mean over tokens, whose rounding errors average out).
"""
import pytest
import torch
import torch.nn.functional as F

from tiny import import_triton
triton = import_triton()
from picotron.speed.kernels import triton_loss  # noqa: E402
from picotron.loss import IGNORE_INDEX  # noqa: E402
from picotron.speed.loss import HeadInLoss, LinearCrossEntropy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_loss, "_block", lambda n_cols: 128)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(dtype, N=70, C=24, V=300, ignored=(3, 4, 50)):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(N, C, device=DEVICE, generator=g).to(dtype)
    w = (0.3 * torch.randn(V, C, device=DEVICE, generator=g)).to(dtype)
    t = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    t[list(ignored)] = IGNORE_INDEX
    return h, w, t


def grads(fn, h, w, grad_out):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w)
    (loss * grad_out).backward()
    return loss.detach(), h.grad, w.grad


def reference(t):       # fp32 logits, torch's cross-entropy, mean over the counted tokens
    return lambda h, w: F.cross_entropy(h.float() @ w.float().t(), t, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("rows", [70, 32, 9])        # one chunk; several; a ragged last one
def test_fp32_matches_cross_entropy(rows):
    h, w, t = problem(torch.float32)
    ours = grads(lambda h, w: triton_loss.triton_linear_cross_entropy(h, w, t, rows), h, w, 0.5)
    ref = grads(reference(t), h, w, 0.5)           # grad_out 0.5: backward must scale by it
    assert abs(ours[0] - ref[0]) < 1e-5 * ref[0]
    assert rel(ours[1], ref[1]) < 1e-5 and rel(ours[2], ref[2]) < 1e-5
    assert ours[1][[3, 4, 50]].abs().max() == 0      # ignored tokens get no gradient


def test_a_second_backward_gives_the_same_gradients():
    h, w, t = problem(torch.float32)
    h.requires_grad_(), w.requires_grad_()
    loss = triton_loss.triton_linear_cross_entropy(h, w, t, 32)
    first = torch.autograd.grad(loss * 0.5, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss * 0.5, (h, w))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_without_grad_only_the_loss():
    h, w, t = problem(torch.float32)
    with torch.no_grad():
        loss = triton_loss.triton_linear_cross_entropy(h, w, t, 16)
    assert abs(loss - reference(t)(h, w)) < 1e-5 * loss


def test_all_targets_ignored_gives_zero_not_nan():
    h, w, t = problem(torch.float32, N=8, ignored=range(8))
    loss, gh, gw = grads(lambda h, w: triton_loss.triton_linear_cross_entropy(h, w, t, 4),
                         h, w, 1.0)
    assert loss == 0 and gh.abs().max() == 0 and gw.abs().max() == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 rounding: the CPU interpreter truncates")
def test_bf16_within_one_rounding():
    h, w, t = problem(torch.bfloat16, N=4096, C=256, V=5000, ignored=(0, 7))
    ours = grads(lambda h, w: triton_loss.triton_linear_cross_entropy(h, w, t, 1024), h, w, 1.0)
    ref = grads(reference(t), h, w, 1.0)
    assert abs(ours[0] - ref[0]) < 2e-3 * ref[0]
    assert rel(ours[1], ref[1]) < 1e-2 and rel(ours[2], ref[2]) < 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="host syncs exist on CUDA only")
def test_no_host_sync():
    """The reason this loss exists: forward and backward never wait for the GPU (liger's does,
    twice). torch raises on any synchronizing call under sync debug mode "error"."""
    h, w, t = problem(torch.bfloat16, N=4096, C=256, V=5000)
    h.requires_grad_(), w.requires_grad_()
    triton_loss.triton_linear_cross_entropy(h, w, t, 1024).backward()    # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_loss.triton_linear_cross_entropy(h, w, t, 1024).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_linear_cross_entropy_option_uses_it():
    """training.fused_loss="triton" through the loss object train.py builds: the head's weight,
    moved into the loss."""
    h, w, t = problem(torch.float32)
    head = HeadInLoss(torch.nn.Parameter(w.clone()))
    loss = LinearCrossEntropy(head, "triton")(h[None], t[None])
    assert abs(loss - reference(t)(h, w)) < 1e-5 * loss
