"""training.fp8's weight cache (picotron/speed/fp8/weights.py) and the "rowwise_bf16_dw" recipe,
on the GPU where there is one, else on CPU (our Triton kernels in the interpreter there:
tests/conftest.py sets it only on machines without a GPU).

- each FP8 module casts its weight once per optimizer step: one cast for two micro-batches'
  forwards and backwards (with and without recomputation, our kernels or torch's), and the
  numbers are bitwise those of casting at every use;
- the optimizer step invalidates it: train.py's build and step with the reference AdamW and
  with our fused one (Triton's interpreter on CPU) recast once per step, and train like the
  run that casts at every use;
- "rowwise_bf16_dw": y and dx bitwise rowwise's, dW the plain product dy^T x;
- under CUDA graphs (`in_place` caches), `recast` (then `mark_fresh`) writes a changed weight into
  the same tensors, with the values a fresh cast gives, also W^T after a forward without gradients;
- no cache under ZeRO-3.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from launch import write_config
from tiny import import_triton
from picotron.model import Decoder
from picotron.speed import apply_speed
from picotron.speed.fp8.linear import fp8_linear
from test_fp8 import fp8_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def caches(model):
    """{module name: its Fp8WeightCache} for every module apply_fp8 gave one."""
    return {name: m.fp8_cache for name, m in model.named_modules()
            if getattr(m, "fp8_cache", None) is not None}


def build(recipe, kernels, checkpointing):
    from picotron.loss import causal_lm_loss
    config = fp8_config(recipe, kernels=kernels)
    config.training.activation_checkpointing = checkpointing
    torch.manual_seed(1)
    model, _ = apply_speed(Decoder(config.model).to(DEVICE), causal_lm_loss, config)
    return model, causal_lm_loss


# the modules whose caches the forward uses: the fused q/k/v and gate/up blocks with our
# kernels (their projections' own go unused), each projection with torch's
USED = {"triton": ["self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj"],
        "torch": [f"self_attn.{p}_proj" for p in "qkvo"]
        + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]}


@pytest.mark.parametrize("recipe,kernels,checkpointing", [
    ("tensorwise", "torch", "full"), ("rowwise", "triton", "selective"),
    ("rowwise_bf16_dw", "triton", "none")])
def test_one_cast_per_step_and_the_same_numbers(recipe, kernels, checkpointing):
    """Two micro-batches, forward and backward: every cache cast once (forward, recomputed
    forward and backward all hit); gradients and losses bitwise those without caches; an
    in-place update of the weights (as the optimizer's) makes the next forward recast."""
    if kernels == "triton":
        import_triton()
    ids = torch.randint(0, 64, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEVICE)
    results = []
    # the math attention on a GPU: flash / cuDNN attention's backward accumulates with atomics,
    # so two identical backwards differ in the last bits there, cache or not
    with sdpa_kernel(SDPBackend.MATH):
        for cached in (True, False):
            results.append(two_micro_batches(recipe, kernels, checkpointing, ids, cached))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert all(torch.equal(a, b) for a, b in zip(loss_a, loss_b)), (loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def two_micro_batches(recipe, kernels, checkpointing, ids, cached):
    """(losses, gradients) of two micro-batches and a forward after an in-place update, with
    or without the weight caches; with them, the cast counts are checked on the way."""
    model, loss_fn = build(recipe, kernels, checkpointing)
    found = caches(model)
    if not cached:
        for name, m in model.named_modules():
            if name in found:
                m.fp8_cache = None
    losses = []
    for mb in ids:
        loss = loss_fn(model(mb[:, :-1]), mb[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    if cached:
        used = {n: c for n, c in found.items() if c.casts}
        assert sorted(used) == sorted(f"layers.{i}.{name}" for i in range(2)
                                      for name in USED[kernels])
        assert {n: c.casts for n, c in used.items()} == {n: 1 for n in used}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)                         # in place: every version moves on
        losses.append(loss_fn(model(ids[0, :, :-1]), ids[0, :, 1:]).detach())
        assert {n: c.casts for n, c in used.items()} == {n: 2 for n in used}
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        losses.append(loss_fn(model(ids[0, :, :-1]), ids[0, :, 1:]).detach())
    return losses, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("fused_adam", [False, True])
def test_the_optimizer_step_recasts(tmp_path, fused_adam):
    """train.py's build and steps (2 micro-batches a step): each cache casts once per
    optimizer step, with DistributedAdamW and with TritonAdamW (the weights written through
    flat buffers, whose version counters are not the parameters'); and the losses are bitwise
    those of casting at every use, so no step ran on stale FP8 weights."""
    if fused_adam:
        import_triton()
    import train
    from picotron.data.windows import StepBatches, build_train_val
    from picotron.speed.adamw import TritonAdamW
    # The debug model cut to 2 narrow layers: on CI, TritonAdamW runs in Triton's interpreter.
    path = write_config(tmp_path, "fp8", ["--mbs", "2", "--seq_len", "32", "--grad_acc_steps",
                                          "2", "--total_train_steps", "3",
                                          "--num_hidden_layers", "2",
                                          "--set", "model.hidden_size=128",
                                          "--set", "model.intermediate_size=256"])
    runs = []
    gpu = [] if DEVICE == "cpu" else ["distributed.use_cpu=false"]
    for cached in (True, False):
        config, pgm, device = train.setup(path, gpu)
        config.training.fp8 = "rowwise"
        model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
        if fused_adam:
            optimizer = TritonAdamW(grads, pgm, config)
        found = caches(model)
        if not cached:
            for m in model.modules():
                if getattr(m, "fp8_cache", None) is not None:
                    m.fp8_cache = None
        batches = StepBatches(build_train_val(config, str(tmp_path))[0], config, pgm, device)
        runs.append([train.queue_step(model, loss_fn, grads, optimizer, batches, i, config, pgm,
                                      device).read()["loss"] for i in range(3)])
        if cached:
            counts = {n: c.casts for n, c in found.items() if c.casts}
            per_layer = len(USED[config.model.kernels])     # our kernels on a GPU: fused blocks
            assert len(counts) == per_layer * config.model.num_hidden_layers, counts
            assert set(counts.values()) == {3}, counts
    assert runs[0] == runs[1], runs


def test_rowwise_bf16_dw_is_rowwise_with_an_exact_weight_gradient():
    """y and dx as rowwise gives them, bit for bit; dW = dy^T x as the plain product (fp32 on
    CPU; bf16 on the GPU, where row-scaled FP8 GEMMs write bf16 only), the same for both fused
    weights."""
    torch.manual_seed(0)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x, dy = (torch.randn(3, 16, c, device=DEVICE).to(dtype) for c in (64, 80))
    x[0, 3] *= 50
    ws = [(0.05 * torch.randn(o, 64, device=DEVICE)).to(dtype) for o in (48, 32)]
    out = {}
    for recipe in ("rowwise", "rowwise_bf16_dw"):
        xs, wss = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
        y = fp8_linear(xs, wss, recipe)
        y.backward(dy)
        out[recipe] = y.detach(), xs.grad, torch.cat([w.grad for w in wss])
    (y_r, dx_r, dw_r), (y_b, dx_b, dw_b) = out["rowwise"], out["rowwise_bf16_dw"]
    assert torch.equal(y_b, y_r) and torch.equal(dx_b, dx_r)
    exact = dy.reshape(-1, 80).t() @ x.reshape(-1, 64)
    assert torch.equal(dw_b, exact)
    assert not torch.allclose(dw_r, exact, rtol=1e-3, atol=0), "rowwise's dW ran in FP8"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_in_place_caches_refresh_into_the_same_tensors(recipe):
    """What a captured graph needs (speed/cuda_graphs.py): after an in-place weight update the
    caches are `stale`, and `recast` and `mark_fresh` (what cuda_graphs.py replays and runs) write
    into the very tensors the capture read, with the bits a new cache would cast; then the
    forward hits. A forward without gradients after an update (validation) recasts W^T too,
    which the next backward reads."""
    from picotron.speed.fp8.weights import Fp8WeightCache
    model, loss_fn = build(recipe, "torch", "none")
    found = caches(model)
    for cache in found.values():
        cache.in_place = True
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()

    def tensors(entry):
        return entry.w_q, entry.w_s, *entry.t

    def check_fresh():
        for cache in found.values():
            weights, rowwise, in_group, out_group = cache.source
            fresh = Fp8WeightCache().get(weights, weights[0], rowwise, in_group, out_group,
                                         transposed=True)
            assert all(torch.equal(a.float(), b.float())
                       for a, b in zip(tensors(cache.entry), tensors(fresh)))
    pointers = {n: [t.data_ptr() for t in tensors(c.entry)] for n, c in found.items()}
    for update in ("recast", "no_grad forward", "recast again"):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
            assert all(cache.stale() for cache in found.values())
            if update.startswith("recast"):
                for cache in found.values():
                    cache.recast()
                    cache.mark_fresh()
            else:
                model(ids[:, :-1])
        assert not any(cache.stale() for cache in found.values())
        check_fresh()
        assert {n: [t.data_ptr() for t in tensors(c.entry)] for n, c in found.items()} \
            == pointers
    counts = {n: c.casts for n, c in found.items()}
    assert set(counts.values()) == {4}, counts
    loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()          # hits: nothing changed
    assert {n: c.casts for n, c in found.items()} == counts


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_in_place_recast_of_a_late_transpose(recipe):
    """W^T cast after W (a first forward without gradients, then training): recast in place
    writes it too, scale included (tensorwise: W's one scale serves both layouts, one tensor)."""
    from picotron.speed.fp8.weights import Fp8WeightCache
    model, loss_fn = build(recipe, "torch", "none")
    found = caches(model)
    for cache in found.values():
        cache.in_place = True
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        model(ids[:, :-1])
    assert all(c.entry.t is None for c in found.values())
    loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    for cache in found.values():
        assert cache.stale()
        cache.recast()
        cache.mark_fresh()
        weights, rowwise, in_group, out_group = cache.source
        fresh = Fp8WeightCache().get(weights, weights[0], rowwise, in_group, out_group,
                                     transposed=True)
        mine = cache.entry
        assert (mine.t[1] is mine.w_s) == (recipe == "tensorwise")
        for a, b in zip((mine.w_q, mine.w_s, *mine.t), (fresh.w_q, fresh.w_s, *fresh.t)):
            assert torch.equal(a.float(), b.float())


def test_no_cache_under_zero3():
    """ZeRO-3 holds only the layer in use whole: the FP8 modules cast at each use instead."""
    from picotron.speed.fp8.layers import apply_fp8
    config = fp8_config("rowwise")
    model = apply_fp8(Decoder(config.model), config)
    assert len(caches(model)) == 7 * 2
    config.distributed.zero_stage = 3
    model = apply_fp8(Decoder(config.model), config)
    assert not caches(model) and any(hasattr(m, "fp8_cache") for m in model.modules())
