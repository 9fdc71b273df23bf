"""training.fp8 on CPU (torch._scaled_mm runs there too): the FP8 linear against the exact
product within bounds derived from the formats' precision, forward and both gradients, both
recipes; the recomputing SwiGLU + down projection against the SwiGLU then the FP8 linear;
which modules the plug-in swaps; recomputation; tp = 2 against one
rank (tests/workers/fp8_tp_worker.py). The config's refusals: tests/test_fp8_config.py.
Training in FP8 needs a GPU: tests/test_fp8_gpu.py."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from launch import ROOT, launch_script, write_config
from tiny import import_triton
from picotron.config import Config, DistributedConfig, ModelConfig, TrainingConfig
from picotron.model import Decoder
from picotron.speed.fp8 import linear as fp8_module
from picotron.speed.fp8.linear import E4M3, E5M2, fp8_linear
from picotron.speed.fp8.layers import (Fp8ColumnParallelLinear, Fp8Linear, Fp8RowParallelLinear,
                                       apply_fp8)
from picotron.speed.recompute import apply_activation_checkpointing
from picotron.tensor_parallel import apply_tensor_parallel


def rounding(fmt):
    """(u, e): |fp8(v) - v| <= u |v| + e for v in the format's range: u is half the relative
    step (2^-(mantissa bits + 1)), e half the smallest subnormal (for values below the normals)."""
    mantissa = {E4M3: 3, E5M2: 2}[fmt]
    smallest_subnormal = torch.finfo(fmt).smallest_normal * 2.0 ** -mantissa
    return 2.0 ** -(mantissa + 1), smallest_subnormal / 2


def product_bound(a, b, fmt_a, fmt_b):
    """Elementwise bound on |fp8 GEMM - a @ b^T| for a (M, K), b (N, K) each quantized with one
    scale s = amax / fp8_max (the coarsest a rowwise scale can be, so it bounds both recipes):
    with |a~ - a| <= u_a|a| + e_a s_a and the same for b,
    |a~ b~ - a b| <= |a~ - a| |b~| + |a| |b~ - b|, summed over K; plus fp32 accumulation."""
    (ua, ea), (ub, eb) = rounding(fmt_a), rounding(fmt_b)
    ea = ea * a.abs().max() / torch.finfo(fmt_a).max
    eb = eb * b.abs().max() / torch.finfo(fmt_b).max
    a_err, b_err = ua * a.abs() + ea, ub * b.abs() + eb
    return a_err @ (b.abs() + b_err).t() + a.abs() @ b_err.t() + 1e-6 * a.abs() @ b.abs().t()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_within_the_formats_rounding(recipe):
    """y = x W^T and both gradients against fp32, within product_bound for the formats each
    recipe uses (dy: e5m2 tensorwise, e4m3 rowwise); two weights fused into one GEMM, as q/k/v.
    The error must also exceed what fp32 would make: the GEMMs really ran in FP8."""
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64)
    x[0, 3] *= 50                                               # an outlier token
    w1, w2 = 0.05 * torch.randn(48, 64), 0.05 * torch.randn(32, 64)
    dy = torch.randn(3, 16, 80)
    xs, w1s, w2s = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = fp8_linear(xs, [w1s, w2s], recipe)
    y.backward(dy)
    w, x2, dy2 = torch.cat([w1, w2]), x.reshape(-1, 64), dy.reshape(-1, 80)
    grad_fmt = E5M2 if recipe == "tensorwise" else E4M3
    checks = [("y", y.reshape(-1, 80), x2 @ w.t(), product_bound(x2, w, E4M3, E4M3)),
              ("dx", xs.grad.reshape(-1, 64), dy2 @ w, product_bound(dy2, w.t(), grad_fmt, E4M3)),
              ("dW", torch.cat([w1s.grad, w2s.grad]), dy2.t() @ x2,
               product_bound(dy2.t(), x2.t(), grad_fmt, E4M3))]
    for name, got, exact, bound in checks:
        err = (got - exact).abs()
        assert (err <= bound).all(), f"{name}: error {(err - bound).max():.3g} past the bound"
        assert err.max() > 1e-3 * exact.abs().max(), f"{name} is too exact for FP8"
    assert xs.grad.dtype == x.dtype and w1s.grad.shape == w1.shape


def test_rowwise_scales_are_per_row_tensorwise_are_not():
    """An outlier row changes no other row's rowwise result, bit for bit (each row has its own
    scale), and changes the others' tensorwise results (one scale for all)."""
    torch.manual_seed(1)
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    loud = x.clone()
    loud[0] *= 2.0 ** 10
    for recipe, same in (("rowwise", True), ("tensorwise", False)):
        quiet_y, loud_y = fp8_linear(x, [w], recipe), fp8_linear(loud, [w], recipe)
        assert torch.equal(quiet_y[1:], loud_y[1:]) is same, recipe


def test_fp8_linear_takes_bf16():
    """bf16 in, bf16 out and bf16 gradients, as the bf16 path returns them."""
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    for recipe in ("tensorwise", "rowwise"):
        y = fp8_linear(x, [w], recipe)
        y.sum().backward()
        assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert y._base is None      # fresh, not a view: the packed SwiGLU may write over it
    with pytest.raises(ValueError, match="recipe"):
        fp8_linear(x, [w], "blockwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_swiglu_linear_is_swiglu_then_the_fp8_linear(recipe):
    """The recomputing SwiGLU + down projection ("selective" with our kernels; the Triton
    SwiGLU runs in Triton's interpreter on CPU, tests/conftest.py) gives exactly what the
    SwiGLU followed by the FP8 linear gives, output and both gradients: the same h, cast the
    same way, whether kept or recomputed."""
    import_triton()
    torch.manual_seed(2)
    gu, w, dy = torch.randn(2, 16, 96), 0.1 * torch.randn(32, 48), torch.randn(2, 16, 32)
    assert_swiglu_kept_equals_recomputed(gu, w, dy, recipe)


def assert_swiglu_kept_equals_recomputed(gu, w, dy, recipe):
    """Fp8SwiGLULinear (h recomputed in backward) against the SwiGLU then the FP8 linear (h
    kept): output and both gradients bitwise equal. Shared with tests/test_fp8_gpu.py."""
    from picotron.speed.fp8.linear import recipe_of
    from picotron.speed.fp8.triton_layers import Fp8SwiGLULinear
    from picotron.speed.kernels.triton_swiglu import swiglu_packed
    results = []
    for fn in (lambda g, w: fp8_linear(swiglu_packed(g * 1), [w], recipe),
               lambda g, w: Fp8SwiGLULinear.apply(g * 1, recipe_of(recipe), None, None, None,
                                                   None, w)):
        g, ws = gu.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(g, ws)           # g * 1: a fresh intermediate, overwritten in place as in the MLP
        y.backward(dy)
        results.append((y.detach(), g.grad, ws.grad))
    for name, ref, got in zip(("y", "d gu", "dW"), *results):
        assert torch.equal(got, ref), name


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def fp8_config(recipe="tensorwise", kernels="torch", tp=1):
    """Built directly, not loaded: the loaded config refuses FP8 on CPU."""
    return Config(model=ModelConfig(**TINY, kernels=kernels),
                  training=TrainingConfig(fp8=recipe, activation_checkpointing="none",
                                          fused_loss="none"),
                  distributed=DistributedConfig(use_cpu=True, tp_size=tp))


def test_only_the_decoder_projections_are_swapped(monkeypatch):
    """Projections in FP8; embedding, head and norms not; names and tensors unchanged (a
    checkpoint does not know); every projection's forward goes through the FP8 GEMM."""
    torch.manual_seed(0)
    model = Decoder(fp8_config().model)
    before = {name: p for name, p in model.named_parameters()}
    apply_fp8(model, fp8_config("rowwise"))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    for name, module in model.named_modules():
        swapped = isinstance(module, Fp8Linear)
        assert swapped == (name.rpartition(".")[2] in PROJECTIONS), name
        assert not swapped or module.fp8_recipe == "rowwise"
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    calls = []
    real = fp8_module.Fp8Linear.apply
    monkeypatch.setattr(fp8_module.Fp8Linear, "apply", lambda *a: calls.append(1) or real(*a))
    loss = model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean()
    loss.backward()
    assert len(calls) == len(PROJECTIONS) * TINY["num_hidden_layers"]
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_sharded_and_fused_projections_are_swapped():
    """Under tp = 2 (on the meta device): column-parallel projections scale over the TP group
    on their outputs, row-parallel on their inputs; with model.kernels='triton' the fused q/k/v
    and gate/up blocks become their FP8 subclasses too."""
    from picotron.speed.fp8.triton_layers import Fp8TritonAttention, Fp8TritonMLP
    from picotron.speed.kernels.swap import apply_kernels
    config = fp8_config(kernels="triton", tp=2)
    pgm = SimpleNamespace(tp_rank=0, tp_size=2, tp_group="the tp group")
    with torch.device("meta"):
        model = apply_tensor_parallel(Decoder(config.model), pgm, config)
    apply_fp8(apply_kernels(model, config), config, tp_group="the tp group")
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        assert type(attn) is Fp8TritonAttention and type(mlp) is Fp8TritonMLP
        assert attn.fp8_group == mlp.fp8_group == "the tp group"
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            assert type(proj) is Fp8ColumnParallelLinear and proj.fp8_group == "the tp group"
        for proj in (attn.o_proj, mlp.down_proj):
            assert type(proj) is Fp8RowParallelLinear
    assert type(model.lm_head).__name__ == "VocabParallelHead"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_the_same_fp8_gradients(mode):
    """Recomputation reruns the same casts on the same inputs (selective keeps the FP8 GEMMs'
    outputs): the gradients are bitwise those without it."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    grads = []
    for checkpointing in ("none", mode):
        torch.manual_seed(1)
        config = fp8_config("tensorwise")
        config.training.activation_checkpointing = checkpointing
        model = apply_activation_checkpointing(apply_fp8(Decoder(config.model), config), config)
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_with_our_kernels_recomputes_exactly(recipe, mode):
    """model.kernels='triton' (Triton's interpreter on CPU) with FP8: the fused q/k/v and
    gate/up blocks swapped; "selective" (the MLP's recomputing FP8 SwiGLU + down projection)
    and "full" give bitwise the gradients of no recomputation."""
    import_triton()
    from picotron.loss import causal_lm_loss
    from picotron.speed import apply_speed
    from picotron.speed.fp8.triton_layers import Fp8TritonAttention, Fp8TritonMLP
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in ("none", mode):
        config = fp8_config(recipe, kernels="triton")
        config.training.activation_checkpointing = checkpointing
        torch.manual_seed(1)
        model, _ = apply_speed(Decoder(config.model), causal_lm_loss, config)
        mlp = model.layers["0"].mlp
        assert type(model.layers["0"].self_attn) is Fp8TritonAttention
        assert type(mlp) is Fp8TritonMLP and mlp.recompute_swiglu == (checkpointing == "selective")
        causal_lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[1][n], g) for n, g in grads[0].items())


def test_fp8_trains_like_the_reference_on_cpu(tmp_path):
    """train.py's build and step (train.queue_step), the debug model on the embedded corpus,
    40 steps from the same seed: each recipe's loss over the last 10 steps within 1% of the
    reference's (the bar FP8 training is held to). The loaded config refuses FP8 on CPU (no
    FP8 tensor cores), so the field is set after loading; the math is the GPU's."""
    import train
    from picotron.data.windows import StepBatches, build_train_val
    path = write_config(tmp_path, "fp8", ["--mbs", "4", "--seq_len", "64",
                                          "--total_train_steps", "40"])
    finals = {}
    for recipe in ("none", "tensorwise", "tensorwise_delayed", "rowwise", "rowwise_bf16_dw"):
        config, pgm, device = train.setup(path)
        config.training.fp8 = recipe
        model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
        assert any(isinstance(m, Fp8Linear) for m in model.modules()) == (recipe != "none")
        batches = StepBatches(build_train_val(config, str(tmp_path))[0], config, pgm, device)
        losses = [train.queue_step(model, loss_fn, grads, optimizer, batches, i, config, pgm,
                                   device).read()["loss"] for i in range(40)]
        assert losses[-1] < losses[0] - 1.0, f"{recipe} did not train: {losses}"
        finals[recipe] = sum(losses[-10:])
    for recipe in ("tensorwise", "tensorwise_delayed", "rowwise", "rowwise_bf16_dw"):
        gap = abs(finals[recipe] - finals["none"]) / finals["none"]
        assert gap < 0.01, f"{recipe}: {gap:.3%} from the reference"


def test_tp2_scales_are_the_full_tensors():
    """Column- and row-parallel FP8 linears on 2 gloo ranks against one rank's FP8 linear:
    the same scales, so the same numbers up to fp32 summation order (the worker says more)."""
    launch_script(os.path.join(ROOT, "tests", "workers", "fp8_tp_worker.py"), 2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_only_the_forward_gemm_accumulates_fast(monkeypatch, recipe):
    """y = x W^T asks the tensor cores for fast accumulation (fp8.FORWARD_FAST_ACCUM); dx and
    dW, summed over more terms, for fp32 promotion throughout."""
    calls, real = [], torch._scaled_mm

    def spy(*args, use_fast_accum=False, **kwargs):
        calls.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(48, 64, requires_grad=True)
    y = fp8_linear(x, [w], recipe)
    assert calls == [True]
    y.backward(torch.randn_like(y))
    assert calls == [True, False, False]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_bf16_dw"])
def test_a_compiled_fp8_layer_is_one_graph(recipe):
    """training.compile traces each FP8 layer whole (fullgraph: a graph break raises), the
    casts and GEMMs of both passes inside, and trains like the eager layer (fp32 op order).
    The weights' casts made inside the autograd function change nothing after they are made
    (fp8_weights.OneUseCasts): a WeightCasts object there broke the graph at every projection,
    and dynamo then compiled each projection's forward apart, once per weight shape."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch.manual_seed(1)
        config = fp8_config(recipe)
        model = apply_fp8(Decoder(config.model), config)
        if compiled:
            for layer in model.layers.values():
                layer.compile(backend="aot_eager", fullgraph=True, dynamic=False)
        logits = model(ids)
        logits.float().logsumexp(-1).mean().backward()
        results.append([logits.detach()] + [p.grad for p in model.parameters()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
