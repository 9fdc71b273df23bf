"""picotron/speed/kernels/triton_adamw.py against torch.optim.AdamW, step by step.

Runs on a GPU, and on CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
sizes span several blocks plus a ragged tail (BLOCK = 2048).

Tolerances. fp32 weights and moments: the kernel does torch's arithmetic in the same order in
fp32, so 5 steps agree to 1e-6 relative (a few roundings of difference: fused multiply-adds).
bf16 weights/moments: torch's foreach AdamW rounds to bf16 after each of its ops, the kernel
once per stored value, so both are compared with an fp64 run of the same steps and the kernel
must be no further from it than torch is (x1.5, plus bf16's half step 2^-9).

On CPU, Triton's interpreter (3.6) converts fp32 to bf16 by truncation whatever the rounding
mode asked (its `_convert_float` drops the carry), so there each stored bf16 value may be one
bf16 step (2^-7 relative) off where the GPU rounds to nearest: the bf16 bounds get that step,
and the strict ones run on the GPU.
"""
import pytest
import torch

from tiny import import_triton
triton = import_triton()
from picotron.speed.kernels.triton_adamw import adamw_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_STEP = 2 ** -7 if DEVICE == "cpu" else 0.0     # see the docstring: the interpreter truncates
SIZES = [5000, 700] if DEVICE == "cpu" else [3_000_001, 4096]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(weights, grads_per_step, dtype, lr, wd, mul):
    """torch's foreach AdamW on `dtype` copies, grads pre-multiplied by `mul`."""
    params = [w.detach().to(dtype).clone().requires_grad_() for w in weights]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd,
                            foreach=True)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = (g.double() * mul).to(dtype)
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["exp_avg"] for p in params]


def ours(weights, grads_per_step, wdtype, master, lr, wd, mul, skip=0.0, gdtype=torch.float32):
    shards = [w.detach().to(wdtype).clone() for w in weights]
    masters = [s.float().clone() if master else s for s in shards]
    opt = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    scalars = torch.tensor([mul, skip], device=DEVICE)
    for grads in grads_per_step:
        adamw_step(opt, dict(zip(masters, [g.to(gdtype) for g in grads])),
                   {m: s for m, s in zip(masters, shards) if m is not s}, scalars)
    return shards, masters, [opt.state[m]["exp_avg"] for m in masters]


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    weights = [torch.randn(n, device=DEVICE, generator=g) * 0.02 for n in SIZES]
    steps = [[torch.randn(n, device=DEVICE, generator=g) * 1e-3 for n in SIZES]
             for _ in range(5)]
    return weights, steps


@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_fp32_matches_torch(problem, wd):
    weights, steps = problem
    want, want_m = reference(weights, steps, torch.float32, 3e-3, wd, 0.5)
    got, _, got_m = ours(weights, steps, torch.float32, False, 3e-3, wd, 0.5)
    for a, b, am, bm in zip(got, want, got_m, want_m):
        assert rel(a, b) < 1e-6 and rel(am, bm) < 1e-6, (rel(a, b), rel(am, bm))


@pytest.mark.parametrize("master", [False, True])
def test_bf16_as_close_to_fp64_as_torch(problem, master):
    weights, steps = problem
    exact, _ = reference(weights, steps, torch.float64, 3e-3, 0.1, 0.5)
    if master:      # the fp32 master follows fp32 torch; the bf16 weights are its rounding
        start = [w.bfloat16().float() for w in weights]      # the master starts as the bf16
        torch32, _ = reference(start, steps, torch.float32, 3e-3, 0.1, 0.5)
        shards, masters, _ = ours(weights, steps, torch.bfloat16, True, 3e-3, 0.1, 0.5)
        for s, m, t in zip(shards, masters, torch32):
            assert s.dtype == torch.bfloat16 and rel(m, t) < 1e-5
            # written from the same values: the same rounding (within the interpreter's step)
            assert ((s.float() - m).abs() <= BF16_STEP * m.abs()).all() if BF16_STEP else \
                torch.equal(s, m.bfloat16())
        return
    torch16, _ = reference(weights, steps, torch.bfloat16, 3e-3, 0.1, 0.5)
    got, _, _ = ours(weights, steps, torch.bfloat16, False, 3e-3, 0.1, 0.5)
    for g, t, e in zip(got, torch16, exact):
        assert g.dtype == torch.bfloat16
        assert rel(g, e) < 1.5 * rel(t, e) + 2 ** -9 + 2 * BF16_STEP, (rel(g, e), rel(t, e))
        # and the weights moved: a kernel that wrote nothing would sit at the start
        start = weights[SIZES.index(g.numel())].bfloat16()
        assert rel(g, start) > 0.1 * rel(exact[SIZES.index(g.numel())], start.double())


def test_bf16_gradients_read_as_their_fp32_values(problem):
    """Gradient buffers keep the parameter dtype when nothing is summed into them
    (data_parallel/buckets.py): the kernel must step exactly as on fp32 copies of them."""
    weights, steps = problem
    rounded = [[g.bfloat16().float() for g in grads] for grads in steps]
    want = ours(weights, rounded, torch.bfloat16, False, 3e-3, 0.1, 0.5)
    got = ours(weights, steps, torch.bfloat16, False, 3e-3, 0.1, 0.5, gdtype=torch.bfloat16)
    for a, b in zip(got[0] + got[2], want[0] + want[2]):
        assert torch.equal(a, b)


def test_skip_flag_writes_nothing(problem):
    weights, steps = problem
    got, masters, got_m = ours(weights, steps[:1], torch.float32, False, 3e-3, 0.1, 0.5,
                               skip=1.0)
    for g, w, m in zip(got, weights, got_m):
        assert torch.equal(g, w) and not m.any()


def test_a_skipped_step_is_not_counted(problem):
    """A non-finite step (skip flag set) must leave AdamW's step count t alone, as torch's fused
    AdamW does with found_inf: the steps after it are then those of a torch AdamW that never saw
    it. Counting it would make every later bias correction use t + 1 (t = 4 on the step after
    the skip, where torch has t = 3: updates ~10% off, 1e-2 in the weights), far outside the
    fp32 tolerance of test_fp32_matches_torch, which holds here too: the same arithmetic."""
    weights, steps = problem
    want, want_m = reference(weights, steps[:2] + steps[3:], torch.float32, 3e-3, 0.1, 0.5)
    shards = [w.detach().clone() for w in weights]
    opt = torch.optim.AdamW(shards, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for i, grads in enumerate(steps):
        # step 3 (index 2) overflowed: the flag is a device tensor, as DistributedAdamW makes it
        scalars = torch.tensor([0.5, 1.0 if i == 2 else 0.0], device=DEVICE)
        adamw_step(opt, dict(zip(shards, grads)), {}, scalars)
    for s, w, m, wm in zip(shards, want, [opt.state[s]["exp_avg"] for s in shards], want_m):
        assert rel(s, w) < 1e-6 and rel(m, wm) < 1e-6, (rel(s, w), rel(m, wm))
    assert all(int(opt.state[s]["step"]) == 4 for s in shards)    # what a checkpoint saves


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_triton_adamw_trains_like_the_reference(offload):
    """The optimizer class train.py builds on a GPU (speed/adamw.py: TritonAdamW) against the
    readable DistributedAdamW it subclasses: the same model and batches, 3 steps, fp32. With
    half the optimizer state offloaded to the CPU its step is the reference's, torch's AdamW
    stepping the offloaded masters and the kernel the others."""
    from picotron.config import Config, DistributedConfig, TrainingConfig
    from picotron.data_parallel import DistributedAdamW, GradBuckets
    from picotron.process_group_manager import ProcessGroupManager
    from picotron.speed.adamw import TritonAdamW
    from speed_helpers import build_with_speed
    tiny = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    config = Config(training=TrainingConfig(dtype="float32"),
                    distributed=DistributedConfig(offload_optim_frac=offload,
                                                  use_cpu=DEVICE == "cpu"))
    weights = {}
    for cls in (DistributedAdamW, TritonAdamW):
        model, loss_fn = build_with_speed(tiny, device=DEVICE)
        pgm = ProcessGroupManager()
        grads = GradBuckets(model, pgm, config)
        optimizer = cls(grads, pgm, config)
        assert (optimizer.offload_optimizer is not None) == (offload > 0)
        for step in range(3):
            ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(step))
            grads.sync = True
            loss_fn(model(ids[:, :-1].to(DEVICE)), ids[:, 1:].to(DEVICE)).backward()
            grads.finish()
            _, skipped = optimizer.step(1e-3)
            grads.zero_grad()
            assert not bool(skipped)
        weights[cls] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in weights[DistributedAdamW].items():
        assert rel(weights[TritonAdamW][name], w) < 1e-5, name
