"""The FP8 casts fused into the SwiGLU kernels (picotron/speed/fp8/fused.py) against the
unfused path, bit for bit, on CPU through Triton's interpreter (tests/conftest.py):

- the kernels: h's cast (forward) and d(gu)'s cast (backward) equal fp8_quantize.reference's
  rowwise cast of what the unfused kernels write, values and scales, and the backward still
  writes that d(gu) (in place or not) and h (or leaves dh alone); bf16 and fp32, masked tails,
  several row blocks, a strided gu, zero and tiny rows; the amaxes the SwiGLU kernels take
  for tensorwise scales equal torch's amax of what they write, a NaN included;
- the FP8 MLP of model.kernels="triton" under "selective" (Fp8TritonMLP: gate/up linear, then
  the recomputing SwiGLU + down projection), every recipe: output and every gradient with the
  fusion equal those without it, and the fused casts really ran (the gradient's cast or
  amax was handed over and taken).
tests/test_fp8_gpu.py runs both checks on the GPU at a 1.7B MLP's widths.
"""
import pytest
import torch

from tiny import import_triton
import_triton()
from picotron.speed.fp8 import fused as fp8_fused  # noqa: E402
from picotron.speed.fp8 import quantize as fp8_quantize  # noqa: E402
from picotron.speed.fp8 import triton_layers as fp8_triton  # noqa: E402
from picotron.speed.fp8.quantize import E4M3, reference, reference_amax  # noqa: E402
from picotron.speed.kernels.triton_swiglu import _swiglu_backward, _swiglu_forward  # noqa: E402
from test_fp8 import fp8_config  # noqa: E402
from test_fp8_kernels import assert_same  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INT_OF = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def same_bits(a, b):
    """Equal bit for bit (-0.0 is not 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.view(INT_OF[a.dtype]), b.view(INT_OF[b.dtype]))


def swiglu_operands(n, i, dtype, pad=0, device=DEVICE, seed=0):
    """gu (n, 2I) (a view with row stride 2I + pad if pad), dh (n, I): randn with an outlier
    row and column, a zero row and a tiny row (FP8 subnormals after scaling)."""
    g = torch.Generator().manual_seed(seed)
    gu = 2 * torch.randn(n, 2 * i + pad, generator=g)
    gu[:, 1] *= 30
    gu[1] *= 8
    gu[2] = 0
    gu[3] *= 1e-3
    dh = torch.randn(n, i, generator=g)
    dh[4] *= 1e4
    gu = gu.to(dtype).to(device)
    return (gu[:, :2 * i] if pad else gu), dh.to(dtype).to(device)


def rowwise(t):
    return reference(t, E4M3, "row", reference_amax(t, "row"))


def assert_fused_casts_are_the_reference(gu2, dh2):
    """swiglu_rowwise and swiglu_backward_rowwise against the unfused kernels followed by the
    reference's rowwise cast: q, scales, d(gu) and h bit for bit."""
    q, s = fp8_fused.swiglu_rowwise(gu2)
    assert_same((q, None, s), rowwise(_swiglu_forward(gu2)), "h")
    inplace_ok = gu2.is_contiguous()
    for store_h, inplace in ((True, inplace_ok), (False, inplace_ok), (True, False)):
        outs = []
        for fused in (False, True):
            gu, dh = gu2.clone(), dh2.clone()
            dgu = gu if inplace else torch.empty_like(gu)
            if fused:
                cast = fp8_fused.swiglu_backward_rowwise(dh, gu, dgu, store_h)
            else:
                _swiglu_backward(dh, gu, dgu, store_h)
            outs.append((dgu, dh, cast if fused else None))
        (dgu, dh, _), (dgu_f, dh_f, (q, s)) = outs
        what = f"store_h={store_h} inplace={inplace}"
        assert same_bits(dgu_f, dgu), f"d(gu) {what}"
        assert same_bits(dh_f, dh), f"h (or dh untouched) {what}"
        assert_same((q, None, s), rowwise(dgu), f"d(gu)'s cast {what}")


@pytest.mark.parametrize("tile", [None, (2, 32, 4)], ids=["default tile", "small tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_swiglu_casts_are_the_reference(monkeypatch, dtype, tile):
    """Rows of 2I = 2 x 72 (no multiple of a block: masked tails) and, with the small tile,
    several blocks along a row and two rows a program with an odd row count (masked rows)."""
    if tile:
        monkeypatch.setattr(fp8_fused, "TILE", tile)
    assert_fused_casts_are_the_reference(*swiglu_operands(9, 72, dtype))
    gu, dh = swiglu_operands(7, 40, dtype, pad=6, seed=1)          # strided gu: no in place
    assert_fused_casts_are_the_reference(gu, dh)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_swiglu_kernels_take_the_tensor_amax(dtype):
    """tensorwise: the amax the SwiGLU kernels take of h (forward) and of d(gu) (backward) is
    torch's amax of what they write, which they still write bit for bit; a NaN in dh gives a
    NaN amax (no cast may hide it)."""
    gu2, dh2 = swiglu_operands(9, 72, dtype)
    recipe = fp8_triton.recipe_of("tensorwise")
    h = _swiglu_forward(gu2)
    h_q, h_s, amax = fp8_fused.swiglu_cast(gu2, recipe)
    assert torch.equal(amax, h.abs().amax().float())
    assert_same((h_q, None, h_s), reference(h, E4M3, "tensor", amax), "h's tensorwise cast")
    for nan in (False, True):
        dh = dh2.clone()
        if nan:
            dh[5, 7] = float("nan")
        dgu, want = torch.empty_like(gu2), torch.empty_like(gu2)
        _swiglu_backward(dh.clone(), gu2, want, store_h=True)
        got = fp8_fused.swiglu_backward_cast(dh, gu2, dgu, recipe, store_h=True)[0]
        assert same_bits(dgu.nan_to_num(), want.nan_to_num())
        if nan:
            assert got.isnan()
        else:
            assert torch.equal(got, want.abs().amax().float())


def fp8_mlp(recipe, device=DEVICE, dtype=torch.float32, hidden=64, inter=96):
    """Layer 0's MLP of a model with our kernels, FP8 `recipe` and "selective": an
    Fp8TritonMLP running the recomputing SwiGLU + down projection."""
    from picotron.loss import causal_lm_loss
    from picotron.model import Decoder
    from picotron.speed import apply_speed
    config = fp8_config(recipe, kernels="triton")
    config.model.hidden_size, config.model.intermediate_size = hidden, inter
    config.training.activation_checkpointing = "selective"
    config.distributed.use_cpu = device == "cpu"
    torch.manual_seed(3)
    with torch.device(device):
        model, _ = apply_speed(Decoder(config.model), causal_lm_loss, config)
    mlp = model.layers["0"].mlp.to(dtype)
    assert type(mlp) is fp8_triton.Fp8TritonMLP and mlp.recompute_swiglu
    return mlp


def assert_fused_mlp_is_unfused(monkeypatch, mlp, x, dy):
    """mlp(x) and its gradients (x, gate, up, down) with fp8_fused.FUSED on and off: bitwise
    equal; with it on, h's cast came from swiglu_cast and d(gu)'s was handed over."""
    taken, made = [], []
    take, make = fp8_fused.GradCastHandoff.take, fp8_triton.swiglu_cast
    monkeypatch.setattr(fp8_fused.GradCastHandoff, "take",
                        lambda self, dy: taken.append(take(self, dy)) or taken[-1])
    monkeypatch.setattr(fp8_triton, "swiglu_cast",
                        lambda gu, recipe: made.append(1) or make(gu, recipe))
    results = []
    params = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    for fused in (False, True):
        monkeypatch.setattr(fp8_fused, "FUSED", fused)
        xs = x.clone().requires_grad_()
        for p in params:
            p.grad = None
        y = mlp(xs)
        y.backward(dy)
        results.append((y.detach(), xs.grad, *(p.grad for p in params)))
    assert len(made) == 1 and len(taken) == 1 and taken[0] is not None, "the fusion did not run"
    for name, ref, got in zip(("y", "dx", "dW gate", "dW up", "dW down"), *results):
        assert same_bits(got, ref), name


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_bf16_dw"])
def test_fused_mlp_is_the_unfused_mlp(monkeypatch, recipe):
    """The MLP in bf16 with our cast kernels (forced on CPU), fused against unfused. A tile
    smaller than the row, so the fused kernels walk it in several blocks."""
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t: True)
    monkeypatch.setattr(fp8_fused, "TILE", (1, 32, 4))
    mlp = fp8_mlp(recipe, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    x[0, 3] *= 50
    assert_fused_mlp_is_unfused(monkeypatch, mlp, x.bfloat16().to(DEVICE),
                                dy.bfloat16().to(DEVICE))


def test_the_handoff_refuses_another_gradient():
    """A gradient changed in place after the cast was put, or another tensor: not taken."""
    handoff, grad = fp8_fused.GradCastHandoff(), torch.zeros(4, 6)
    cast = (torch.zeros(4, 6, dtype=E4M3), torch.ones(4, 1))
    handoff.put(grad, *cast)
    got = handoff.take(grad)
    assert got[0] is cast[0] and got[1] is cast[1]
    assert handoff.take(grad) is None                                   # taken once
    handoff.put(grad, *cast)
    grad.add_(1)
    assert handoff.take(grad) is None
    handoff.put(grad, *cast)
    assert handoff.take(grad.clone()) is None
    handoff.put(grad, cast, cast, whole=True)       # a gradient never written: no fallback
    with pytest.raises(RuntimeError, match="did not reach the gate/up projection"):
        handoff.take(grad.clone())


def test_fp8_only_swiglu_is_the_unfused_delayed_path(monkeypatch):
    """"tensorwise_delayed" (calibrating step 1, then steps with the last step's amaxes): with the
    fusion, steps 2 and 3 run the SwiGLU kernels that write only FP8 (h_q forward; d(gu)_q,
    d(gu)_q^T and h^T_q backward, picotron/speed/fp8/delayed_swiglu.py). Output, every gradient and
    the amaxes recorded for the next step: bitwise those of the separate casts."""
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t: True)
    ran, results = [], []
    for name in ("swiglu_fp8", "swiglu_backward_fp8"):
        real = getattr(fp8_triton, name)
        monkeypatch.setattr(fp8_triton, name,
                            lambda *a, real=real, name=name: ran.append(name) or real(*a))
    g = torch.Generator().manual_seed(4)
    inputs = [(s * torch.randn(2, 16, 64, generator=g), s * torch.randn(2, 16, 64, generator=g))
              for s in (1.0, 0.5, 3.0)]
    for fused in (False, True):
        monkeypatch.setattr(fp8_fused, "FUSED", fused)
        mlp = fp8_mlp("tensorwise_delayed", dtype=torch.bfloat16)
        ledger, params = mlp.fp8_sites[0].ledger, list(mlp.parameters())
        got = []
        for x, dy in inputs:
            xs = x.bfloat16().to(DEVICE).requires_grad_()
            for p in params:
                p.grad = None
            y = mlp(xs)
            y.backward(dy.bfloat16().to(DEVICE))
            got += [y.detach(), xs.grad, *(p.grad for p in params), ledger.seen_amaxes()]
            ledger.roll()
        results.append(got)
    assert ran == ["swiglu_fp8", "swiglu_backward_fp8"] * 2, ran
    for i, (ref, got) in enumerate(zip(*results)):
        assert torch.equal(got, ref), f"output {i}"


def test_a_cp_ranks_first_step_scales_by_the_whole_sequence(monkeypatch):
    """"tensorwise_delayed" under context parallelism: the calibrating step's casts (x, h, dy
    and d(gu), fused kernels on) scale by the amax of the whole sequence, here a stand-in cp
    group whose other chunk's amaxes are 3x this rank's (its all-reduce multiplies by 3).
    The same step cast with 3x the amaxes this rank recorded (the delayed path): bitwise
    equal. An h cast from the SwiGLU kernel's own amax, or casts by the chunk's amaxes, fail."""
    import torch.distributed as dist
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t.mul_(3.0))
    mlp = fp8_mlp("tensorwise_delayed", dtype=torch.bfloat16)
    ledger, params = mlp.fp8_sites[0].ledger, list(mlp.parameters())
    ledger.sequence_group = "the cp group"
    g = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(2, 16, 64, generator=g).bfloat16().to(DEVICE) for _ in range(2))
    runs = []
    for _ in range(2):
        xs = x.clone().requires_grad_()
        for p in params:
            p.grad = None
        y = mlp(xs)
        y.backward(dy)
        runs.append([y.detach(), xs.grad, *(p.grad.clone() for p in params)])
        if ledger.calibrating:          # the next run: this rank's own amaxes, times 3
            ledger.roll()
            ledger.scale_amax.mul_(3.0)
    assert not ledger.calibrating and len(ledger.names) >= 4
    for i, (calibrated, delayed) in enumerate(zip(*runs)):
        assert torch.equal(calibrated, delayed), f"output {i}"


def test_the_mlps_forward_gemms_accumulate_fast(monkeypatch):
    """Fp8TritonMLP under "selective": gate/up's and the down projection's forward GEMMs ask
    for fast accumulation, their four gradient GEMMs do not (fp8.FORWARD_FAST_ACCUM)."""
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t: True)
    mlp = fp8_mlp("tensorwise_delayed", dtype=torch.bfloat16)   # on a GPU, probes one GEMM
    calls, real = [], torch._scaled_mm

    def spy(*args, use_fast_accum=False, **kwargs):
        calls.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.randn(2, 16, 64).bfloat16().to(DEVICE).requires_grad_()
    y = mlp(x)
    assert calls == [True, True]
    y.backward(torch.randn_like(y))
    assert calls == [True, True] + [False] * 4
