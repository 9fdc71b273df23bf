"""training.fp8 on a GPU with FP8 tensor cores (skipped elsewhere: CUDA sm89+).

    python -m pytest -q tests/test_fp8_gpu.py

- the recomputing FP8 SwiGLU + down projection against the SwiGLU then the FP8 linear;
- the rowwise casts fused into the SwiGLU kernels (picotron/speed/fp8/fused.py) against the
  reference's cast of the unfused kernels' outputs, and the FP8 MLP with them against without, bit
  for bit, at 1.7B's widths (tests/test_fp8_fused.py's checks);
- the cast kernels (picotron/speed/fp8/cast.py) against fp8_quantize.reference, bit for bit, at
  SmolLM-360M's and 1.7B's projection shapes, every scaling and format (tests/test_fp8_kernels.py
  runs here too, on small shapes);
- the FP8 linear (our cast kernels, cuBLAS FP8 GEMMs) at a SmolLM-360M projection's shape in
  bf16, forward and both gradients, within test_fp8.product_bound plus the bf16 output's
  rounding, every recipe; the reference casts (torch, op by op) within the same bound and
  bitwise equal to the kernels';
- training: the debug model on the embedded corpus, FP8 against bf16 from the same seed with
  model.kernels torch, triton (with and without "selective") and torch + training.compile:
  the FP8 loss follows bf16's;
- training.compile + FP8 validates a smaller last batch (a second shape) like eager FP8;
- an FP8 checkpoint resumes in bf16 (the weights are ordinary bf16 weights);
- with 2 GPUs: tp=2 FP8 against one-GPU FP8, step by step, at bf16 parity's tolerance
  (bench/multi_gpu.py's rule: twice the loss gap of two one-GPU runs splitting the batch
  differently, at least 1e-3).
"""
import os
import sys

import pytest
import torch

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with FP8 (sm89+)")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import create_config  # noqa: E402
from launch import launch, read_metrics  # noqa: E402
from picotron.speed.fp8 import quantize as fp8_quantize  # noqa: E402
from picotron.speed.fp8.linear import E4M3, E5M2, fp8_linear  # noqa: E402
from picotron.speed.fp8.quantize import quantize, reference, reference_amax  # noqa: E402
from test_fp8 import assert_swiglu_kept_equals_recomputed, product_bound  # noqa: E402
from test_fp8_fused import (assert_fused_casts_are_the_reference,  # noqa: E402
                            assert_fused_mlp_is_unfused, fp8_mlp, swiglu_operands)
from test_fp8_kernels import LAYOUTS, assert_same, operand  # noqa: E402

# the bf16 output's rounding: half of bf16's relative step, of |y| <= (1 + 2^-3)^2 sum|a||b|
# (each operand rounded by at most e5m2's 2^-3)
BF16_ROUNDING = 2.0 ** -9 * (1 + 2.0 ** -3) ** 2


def gemm_errors(recipe):
    """[(name, |fp8 - exact|, bound)] for y, dx, dW of q/k/v (fused) at 360M's widths."""
    torch.manual_seed(0)
    N, C, kv = 4096, 960, 320
    x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16)
    ws = [(0.02 * torch.randn(o, C, device="cuda")).bfloat16() for o in (C, kv, kv)]
    dy = torch.randn(N, C + 2 * kv, device="cuda", dtype=torch.bfloat16)
    xs, wss = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    y = fp8_linear(xs, wss, recipe)
    y.backward(dy)
    xf, wf, dyf = x.float(), torch.cat(ws).float(), dy.float()
    grad_fmt = E5M2 if recipe == "tensorwise" else E4M3
    out = []
    for name, got, a, b, fa in (("y", y, xf, wf, E4M3), ("dx", xs.grad, dyf, wf.t(), grad_fmt),
                                ("dW", torch.cat([w.grad for w in wss]), dyf.t(), xf.t(),
                                 grad_fmt)):
        exact = a @ b.t()
        bound = product_bound(a, b, fa, E4M3) + BF16_ROUNDING * (a.abs() @ b.abs().t())
        out.append((name, (got.float() - exact).abs(), bound, got))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,k", [(4096, 960), (4096, 2560), (32768, 2048), (8192, 8192)])
def test_cast_kernels_equal_the_reference_on_gpu(n, k, dtype):
    """Our kernels against the reference at real projection shapes (1.7B: 32768 tokens of
    2048, and W_down's 8192 columns): q, q^T and scales bit for bit, from bf16 and from fp32
    (the master weights' and fp32 gradients' dtype)."""
    for fmt in (E4M3, E5M2):
        x = operand(n, k, dtype)
        for scaling, rows, transposed in LAYOUTS:
            want = reference(x, fmt, scaling, reference_amax(x, scaling), rows, transposed)
            assert_same(quantize(x, fmt, scaling, rows=rows, transposed=transposed), want,
                        f"{n}x{k} {fmt} {scaling} q={rows} q^T={transposed}")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_bf16_dw"])
def test_fp8_linear_within_the_formats_rounding_on_gpu(recipe, monkeypatch):
    kernels = gemm_errors(recipe)                                  # our cast kernels
    for name, err, bound, got in kernels:
        assert got.dtype == torch.bfloat16
        assert (err <= bound).all(), f"{recipe} {name}: {(err - bound).max():.3g} past the bound"
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda x: False)   # the reference casts
    for (name, err, bound, got), (_, _, _, ours) in zip(gemm_errors(recipe), kernels):
        assert (err <= bound).all(), f"reference casts, {recipe} {name}"
        assert torch.equal(got, ours), f"{recipe} {name}: kernels and reference differ"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_bf16_dw"])
def test_fp8_swiglu_linear_on_gpu(recipe):
    """"selective" with our kernels: the SwiGLU + down projection that recomputes h equals the
    Triton SwiGLU followed by the FP8 linear, bit for bit (the same h, cast the same way)."""
    torch.manual_seed(0)
    gu = torch.randn(4, 1024, 2 * 2560, device="cuda", dtype=torch.bfloat16)
    w = (0.02 * torch.randn(960, 2560, device="cuda")).bfloat16()
    dy = torch.randn(4, 1024, 960, device="cuda", dtype=torch.bfloat16)
    assert_swiglu_kept_equals_recomputed(gu, w, dy, recipe)


def test_fused_swiglu_casts_on_gpu():
    """h's and d(gu)'s rowwise casts written by the SwiGLU kernels at I = 8192 (rows of 16384
    for d(gu): several blocks a row, the second pass from L2): the reference's, bit for bit."""
    assert_fused_casts_are_the_reference(*swiglu_operands(2048, 8192, torch.bfloat16))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_bf16_dw"])
def test_fused_fp8_mlp_on_gpu(monkeypatch, recipe):
    """The FP8 MLP under "selective" at 1.7B's widths (C = 2048, I = 8192), 4096 tokens: output
    and gradients with the fused casts equal those without, bit for bit."""
    mlp = fp8_mlp(recipe, device="cuda", dtype=torch.bfloat16, hidden=2048, inter=8192)
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(4, 1024, 2048, device="cuda", generator=g).bfloat16()
             for _ in range(2))
    assert_fused_mlp_is_unfused(monkeypatch, mlp, x, dy)


def run(tmp_path, name, *flags, nproc=1, steps=100, mbs=8, seq=256, acc=1, key="loss"):
    """Train the debug model on the embedded corpus; its losses (or another metric `key`),
    step by step."""
    path = create_config.main([
        "--out_dir", str(tmp_path), "--exp_name", name, "--model_name", "debug",
        "--mbs", str(mbs), "--seq_len", str(seq), "--grad_acc_steps", str(acc),
        "--total_train_steps", str(steps), "--set", "training.dtype=bfloat16",
        "--set", "checkpoint.save_frequency=0", "--set", "checkpoint.save_final=false",
        *flags])
    launch(path, nproc)
    return [r[key] for r in read_metrics(path) if key in r]


@pytest.mark.parametrize("kernels,compile_,ckpt", [
    ("torch", False, "none"), ("triton", False, "selective"), ("triton", False, "none"),
    ("torch", True, "none")])
def test_fp8_trains_like_bf16(tmp_path, kernels, compile_, ckpt):
    """100 steps, same seed and data: FP8's loss over the last 20 steps within 1% of bf16's
    (the convergence bar FP8 training is held to), for every recipe; our kernels with and
    without "selective" (the MLP's recomputing FP8 SwiGLU + down projection)."""
    flags = ["--set", f"model.kernels={kernels}",
             "--set", f"training.compile={str(compile_).lower()}",
             "--set", f"training.activation_checkpointing={ckpt}"]
    bf16 = run(tmp_path, "bf16", *flags)
    for recipe in ("tensorwise", "rowwise", "rowwise_bf16_dw", "tensorwise_delayed"):
        fp8 = run(tmp_path, recipe, *flags, "--set", f"training.fp8={recipe}")
        assert fp8[-1] < fp8[0] - 1.0, f"{recipe} did not train: {fp8}"
        gap = abs(sum(fp8[-20:]) - sum(bf16[-20:])) / sum(bf16[-20:])
        assert gap < 0.01, f"{recipe} ({kernels}, compile={compile_}): {gap:.3%} from bf16"


@pytest.mark.parametrize("recipe", ["tensorwise", "tensorwise_delayed"])
def test_compiled_fp8_validates_a_smaller_last_batch(tmp_path, recipe):
    """training.compile + FP8 with validation batches of 8 windows then 4 (val_samples=12,
    micro-batch 8): the layers compile again for the second shape (static shapes; with
    symbolic sizes the FP8 GEMM has no shape function) and score as eager FP8 does."""
    flags = ["--set", f"training.fp8={recipe}", "--set", "dataset.val_samples=12",
             "--set", "training.val_frequency=5"]
    compiled, eager = (run(tmp_path, f"compile_{c}", *flags, "--set", f"training.compile={c}",
                           steps=10, key="val_loss") for c in ("true", "false"))
    assert len(compiled) == len(eager) == 2
    for c, e in zip(compiled, eager):
        assert abs(c - e) / e < 0.01, f"{recipe}: compiled val loss {c} against eager {e}"


def test_an_fp8_checkpoint_resumes_in_bf16(tmp_path):
    """Same parameter names and dtypes: the FP8 run's checkpoint is an ordinary one."""
    path = create_config.main([
        "--out_dir", str(tmp_path), "--exp_name", "fp8", "--model_name", "debug", "--mbs", "8",
        "--seq_len", "256", "--total_train_steps", "10", "--set", "training.dtype=bfloat16",
        "--set", "training.fp8=tensorwise", "--set", "checkpoint.save_frequency=10"])
    launch(path, 1)
    import train
    train.main(["--config", path, "--set", "checkpoint.load_path=latest", "--set",
                "training.fp8=none", "--set", "training.total_train_steps=15"])
    steps = [r["step"] for r in read_metrics(path) if "loss" in r]
    assert steps[-1] == 15 and 11 in steps


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def layout_against_one_gpu(tmp_path, fp8, *layout, nproc=1):
    """20 steps of `layout` and of one GPU (the same global batch, 8 micro-batches of 2), with
    the tolerance bf16 parity uses: twice the drift of one GPU in other micro-batches (4 of 4),
    at least 1e-3. -> (the largest relative loss difference, the tolerance)."""
    one = run(tmp_path, "one", *fp8, steps=20, mbs=2, seq=64, acc=8)
    split = run(tmp_path, "split", *fp8, steps=20, mbs=4, seq=64, acc=4)
    other = run(tmp_path, "layout", *fp8, *layout, nproc=nproc, steps=20, mbs=2, seq=64, acc=8)
    assert len(other) == len(one) == 20
    return max_rel(other, one), max(2 * max_rel(split, one), 1e-3)


@pytest.mark.parametrize("recipe", ["tensorwise", "tensorwise_delayed"])
def test_zero3_fp8_trains_like_one_gpu_fp8(tmp_path, recipe):
    """ZeRO-3 on one GPU: flat shards, each layer gathered around its use, its weights cast to
    FP8 at each use (not once per step), the gradients in fp32 shards; the same numbers as
    ZeRO-0 up to the order of sums."""
    fp8 = ["--set", f"training.fp8={recipe}", "--set", "training.cuda_graphs=false"]
    diff, tol = layout_against_one_gpu(tmp_path, fp8, "--zero_stage", "3")
    assert diff <= tol, f"ZeRO-3 {diff:.2e} > {tol:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("recipe", ["tensorwise", "tensorwise_delayed", "rowwise",
                                    "rowwise_bf16_dw"])
def test_tp2_fp8_trains_like_one_gpu_fp8(tmp_path, recipe):
    diff, tol = layout_against_one_gpu(tmp_path, ["--set", f"training.fp8={recipe}"],
                                       "--tp", "2", nproc=2)
    assert diff <= tol, f"tp2 {diff:.2e} > {tol:.2e}"
