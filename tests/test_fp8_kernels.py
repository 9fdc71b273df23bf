"""training.fp8's casts as Triton kernels (picotron/speed/fp8/cast.py) against
fp8_quantize.reference, bit for bit: q, q^T and the scales, for every scaling and format.

On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), whose own
conversion to FP8 is wrong (ties away from zero, a lost carry: 125.6 -> 64); the kernels round
onto the FP8 grid in fp32 first (fp8_cast._fp8_round), so the conversion is exact there as on
the GPU, and test_fp8_round_is_torchs_conversion checks that rounding against torch's on every
FP8 value, every midpoint between two and their fp32 neighbours. tests/test_fp8_gpu.py runs
the same comparisons on the GPU at a real projection's size.
"""
import pytest
import torch

from tiny import import_triton
triton = import_triton()
import triton.language as tl  # noqa: E402

from picotron.speed.fp8 import cast as fp8_cast, quantize as fp8_quantize  # noqa: E402
from picotron.speed.fp8.linear import fp8_linear  # noqa: E402
from picotron.speed.fp8.delayed import SLOT_STRIDE, SLOTS  # noqa: E402
from picotron.speed.fp8.quantize import (E4M3, E5M2, FORMATS, quantize,  # noqa: E402
                                         reference, reference_amax)

FP8 = (E4M3, E5M2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (scaling, write q, write q^T): every combination quantize accepts
LAYOUTS = [("tensor", True, True), ("tensor", True, False), ("tensor", False, True),
           ("row", True, False), ("column", False, True)]


@triton.jit
def _round_kernel(v_ptr, q_ptr, n, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                  MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    q = fp8_cast._fp8_round(v, FP8_MAX, MANTISSA, MIN_EXP)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=offs < n)


def bits(t):
    return t.view(torch.uint8) if t.dtype in FP8 else t


def assert_same(got, want, what):
    for name, g, w in zip(("q", "q^T", "scale"), got, want):
        assert (g is None) == (w is None), f"{what}: {name}"
        if w is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {name} {g.shape}"
            bad = (bits(g) != bits(w)).sum().item()
            assert bad == 0, f"{what}: {name} differs in {bad} of {w.numel()}"


@pytest.mark.parametrize("fmt", FP8, ids=["e4m3", "e5m2"])
def test_fp8_round_is_torchs_conversion(fmt):
    """Every finite FP8 value v, the midpoints between neighbours (ties: to even), one fp32
    step either side of each, values past the max (saturate) and below the subnormals: the
    kernel's rounding then conversion equals torch's clamp then conversion, bits and signs."""
    finite = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    finite = finite[finite.isfinite()].unique()                        # sorted, +-0 as one
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mids.nextafter(torch.tensor(-1e30)), mids.nextafter(torch.tensor(1e30))])
    fp8_max = FORMATS[fmt][0]
    extra = torch.tensor([0.0, -0.0, fp8_max * 1.01, -fp8_max * 3, 1e-30, -1e-30, 1e30])
    v = torch.cat([finite, mids, near, extra]).to(DEVICE)
    got = torch.empty(v.shape, dtype=fmt, device=DEVICE)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, got, v.numel(), *FORMATS[fmt], BLOCK=1024)
    want = v.clamp(-fp8_max, fp8_max).to(fmt)
    bad = bits(got) != bits(want)
    assert not bad.any(), f"{v[bad][:5].tolist()} -> {got[bad][:5].float().tolist()}, " \
                          f"torch {want[bad][:5].float().tolist()}"


def operand(n, k, dtype, stride_pad=0):
    """randn (n, k) with an outlier column and row, a zero row, a tiny row and a -0.0: what
    amaxes and the rounding must get right. stride_pad > 0: a view with row stride k + pad."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(n, k + stride_pad, generator=g)
    x[:, 3] *= 300
    x[1] *= 40
    x[2] = 0
    x[3] *= 1e-6
    x[4, 5] = -0.0
    x = x.to(dtype).to(DEVICE)
    return x[:, :k] if stride_pad else x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_equal_the_reference(monkeypatch, dtype):
    """quantize through the kernels against the reference, every layout and format, on shapes
    that are no multiple of any tile (masks) and on a strided view; and the amax-then-cast
    path that tensor parallelism takes (the amax all-reduced between the two kernels)."""
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda x: True)
    cases = [(70, 200, 0), (33, 300, 8), (130, 40, 0)]
    for (n, k, pad), fmt in [(c, f) for c in cases for f in FP8]:
        x = operand(n, k, dtype, pad)
        for scaling, rows, transposed in LAYOUTS:
            what = f"{n}x{k}+{pad} {dtype} {fmt} {scaling} q={rows} q^T={transposed}"
            amax = reference_amax(x, scaling)
            want = reference(x, fmt, scaling, amax, rows, transposed)
            assert_same(quantize(x, fmt, scaling, rows=rows, transposed=transposed), want, what)
            kernel_amax = fp8_cast.amax(x, fp8_quantize.SCALINGS[scaling])
            assert torch.equal(kernel_amax, amax), f"{what}: amax"
            got = fp8_cast.cast(x, kernel_amax, fmt, fp8_quantize.SCALINGS[scaling], rows,
                                transposed)
            assert_same(got, want, what + " (amax, then cast)")


def test_a_nan_is_the_amax():
    """Like torch's amax, the kernels' amax of a tensor (or of its row or column) holding a
    NaN is NaN, wherever it sits among the programs' tiles, and so is its scale (then the
    step's loss), instead of a cast that quietly drops it."""
    for n, k, row, col in [(70, 200, 0, 0), (70, 200, 69, 199), (130, 40, 65, 17)]:
        x = operand(n, k, torch.bfloat16, 0)
        x[row, col] = float("nan")
        assert fp8_cast.amax(x, fp8_cast.TENSOR).isnan()
        for scaling, at in ((fp8_cast.COLUMN, col), (fp8_cast.ROW, row)):
            amaxes = fp8_cast.amax(x, scaling).flatten()
            assert amaxes[at].isnan() and amaxes.isnan().sum() == 1, scaling
        scales = fp8_cast.quantize_rows(x, E4M3)[1].flatten()
        assert scales[row].isnan() and scales.isnan().sum() == 1


def test_the_cast_records_the_amax_of_what_it_casts(monkeypatch):
    """Delayed scaling's cast (picotron/speed/fp8/delayed.py): a given amax (here half the tensor's,
    so values saturate) and the tensor's own amax recorded as the cast runs: q, q^T and the scale
    bitwise the reference's for that amax, the record bitwise reference_amax."""
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda x: True)
    for (n, k, pad), fmt in [(c, f) for c in [(70, 200, 0), (33, 300, 8)] for f in FP8]:
        x = operand(n, k, torch.bfloat16, pad)
        amax = reference_amax(x, "tensor")
        for rows, transposed in [(True, True), (True, False), (False, True)]:
            record = torch.full((), 7, dtype=torch.int32, device=DEVICE)   # below any amax
            got = quantize(x, fmt, "tensor", rows=rows, transposed=transposed, amax=amax / 2,
                           record=record)
            assert_same(got, reference(x, fmt, "tensor", amax / 2, rows, transposed),
                        f"{n}x{k} {fmt} q={rows} q^T={transposed}")
            assert torch.equal(record.view(torch.float32), amax)
            # a delayed site's slots: the programs spread over them, their max is the amax
            slots = torch.full((SLOTS, SLOT_STRIDE), 7, dtype=torch.int32, device=DEVICE)
            quantize(x, fmt, "tensor", rows=rows, transposed=transposed, amax=amax / 2,
                     record=slots)
            assert torch.equal(slots.amax().view(torch.float32), amax)
            row_blocks = -(-n // fp8_cast._tile("cast_recording", x)[0])
            assert (slots[:, 0] != 7).sum() == min(SLOTS, row_blocks), row_blocks
            assert (slots[:, 1:] == 7).all()


def test_delayed_fp8_linear_through_the_kernels(monkeypatch):
    """"tensorwise_delayed" over three steps (calibrating, then the last step's amaxes): the
    kernels give bitwise the reference's outputs, gradients and recorded amaxes."""
    from picotron.speed.fp8.delayed import AmaxLedger
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(2, 24, 64, device=DEVICE, dtype=dtype)
    w = (0.05 * torch.randn(48, 64, device=DEVICE)).to(dtype)
    dy = torch.randn(2, 24, 48, device=DEVICE, dtype=dtype)
    results = []
    for kernels in (False, True):
        monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t, k=kernels: k)
        ledger = AmaxLedger()
        sites, got = (ledger.site("x"), ledger.site("dy")), []
        for scale in (1.0, 0.5, 3.0):
            xs, ws = (x * scale).requires_grad_(), w.clone().requires_grad_()
            y = fp8_linear(xs, [ws], "tensorwise_delayed", sites=sites)
            y.backward(dy * scale)
            got += [y.detach(), xs.grad, ws.grad, ledger.seen_amaxes()]
            ledger.roll()
        results.append(got)
    for i, (ref, got) in enumerate(zip(*results)):
        assert torch.equal(got, ref), f"step {i // 4 + 1}: {('y', 'dx', 'dW', 'amaxes')[i % 4]}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_bf16_dw"])
def test_fp8_linear_through_the_kernels(monkeypatch, recipe):
    """The FP8 linear (fused weights, TP-free) with its casts in our kernels gives bitwise the
    output and gradients it gives with the reference casts: the kernels change no number.
    fp32 on CPU; bf16 on a GPU, whose row-scaled GEMM has no fp32 output."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(2, 24, 64, device=DEVICE, dtype=dtype)
    x[0, 3] *= 50
    ws = [(0.05 * torch.randn(o, 64, device=DEVICE)).to(dtype) for o in (48, 32)]
    dy = torch.randn(2, 24, 80, device=DEVICE, dtype=dtype)
    results = []
    for kernels in (False, True):
        monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t, k=kernels: k)
        xs, wss = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
        y = fp8_linear(xs, wss, recipe)
        y.backward(dy)
        results.append([y.detach(), xs.grad, *(w.grad for w in wss)])
    for name, ref, got in zip(("y", "dx", "dW q", "dW k"), *results):
        assert torch.equal(got, ref), f"{recipe} {name}"


def test_the_kernels_tables_are_the_references():
    """fp8_cast keeps its own copy of the formats and scaling codes (it cannot import
    fp8_quantize, which imports it): the two must agree."""
    assert fp8_cast.FORMATS == FORMATS
    assert (fp8_cast.TENSOR, fp8_cast.ROW, fp8_cast.COLUMN) == tuple(
        fp8_quantize.SCALINGS[s] for s in ("tensor", "row", "column"))
