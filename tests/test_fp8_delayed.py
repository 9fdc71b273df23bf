"""training.fp8="tensorwise_delayed" (picotron/speed/fp8/delayed.py) on CPU: the first step is
tensorwise's, later steps cast with the previous step's amaxes, and data parallelism rolls
them to the scales one process computes with gradient accumulation. Its GPU kernels (the
cast that records the amax) and CUDA graphs: tests/test_fp8_gpu.py, test_cuda_graphs_gpu.py."""
import json
import os

import pytest
import torch

from launch import ROOT, launch_script, write_config
from picotron.speed.fp8.linear import E4M3, E5M2, fp8_linear, scaled_mm
from picotron.speed.fp8.delayed import AmaxLedger
from picotron.speed.fp8.quantize import quantize

W = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))


def fwd_bwd(x, dy, recipe, sites=None):
    """(y, dx, dW) of one FP8 linear y = x W^T."""
    x, w = x.clone().requires_grad_(), W.clone().requires_grad_()
    y = fp8_linear(x, [w], recipe, sites=sites)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def with_amaxes(x, dy, amax_x, amax_dy):
    """(y, dx) of the FP8 linear with x and dy cast by the given amaxes, W by its own."""
    x2, dy2 = x.reshape(-1, 32), dy.reshape(-1, 48)
    x_q, _, x_s = quantize(x2, E4M3, "tensor", amax=torch.tensor(amax_x))
    dy_q, _, dy_s = quantize(dy2, E5M2, "tensor", amax=torch.tensor(amax_dy))
    w_q, wt_q, w_s = quantize(W, E4M3, "tensor", transposed=True)
    return (scaled_mm(x_q, x_s, w_q, w_s, torch.float32).view(*x.shape[:-1], 48),
            scaled_mm(dy_q, dy_s, wt_q, w_s, torch.float32).view(x.shape))


def test_first_step_calibrates_then_each_scale_is_the_last_steps_amax():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, 32, generator=gen) * s for s in (1.0, 0.5, 3.0)]
    dys = [torch.randn(4, 16, 48, generator=gen) * s for s in (1.0, 2.0, 1.0)]
    ledger = AmaxLedger()
    sites = (ledger.site("x"), ledger.site("dy"))
    # step 1 calibrates: every cast takes its own amax, as "tensorwise" does
    got, want = fwd_bwd(xs[0], dys[0], "tensorwise_delayed", sites), fwd_bwd(xs[0], dys[0],
                                                                             "tensorwise")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ledger.roll()
    amax = {"x": xs[0].abs().max().item(), "dy": dys[0].abs().max().item()}
    assert ledger.state() == amax and not ledger.calibrating
    # step 2: cast with step 1's amaxes, not its own (x is half as large, dy twice)
    y, dx, _ = fwd_bwd(xs[1], dys[1], "tensorwise_delayed", sites)
    y_ref, dx_ref = with_amaxes(xs[1], dys[1], amax["x"], amax["dy"])
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert not torch.equal(y, fwd_bwd(xs[1], dys[1], "tensorwise")[0])
    ledger.roll()
    amax = {"x": xs[1].abs().max().item(), "dy": dys[1].abs().max().item()}
    assert ledger.state() == amax
    # a forward without autograd (validation) records nothing; a cast that saw only zeros
    # keeps the last amax; a value above the amax saturates at the format's max
    with torch.no_grad():
        fp8_linear(xs[2], [W], "tensorwise_delayed", sites=sites)
    fwd_bwd(xs[2], torch.zeros_like(dys[2]), "tensorwise_delayed", sites)
    ledger.roll()
    assert ledger.state() == {"x": xs[2].abs().max().item(), "dy": amax["dy"]}
    big = quantize(xs[2].reshape(-1, 32), E4M3, "tensor", amax=torch.tensor(amax["x"]))[0]
    assert big.float().abs().max() == 448.0


STEPS = 4
RTOL = 1e-5     # fp32 summation order, as in every layout's parity
TINY = ["--mbs", "2", "--seq_len", "32", "--num_hidden_layers", "2",
        "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--set", "training.dtype=float32", "--set", "training.warmup_steps=0",
        "--total_train_steps", str(STEPS)]


def test_a_resumed_run_rolls_like_the_run_that_went_on(tmp_path, capsys):
    """One process, train.py's build and step: steps 3 and 4 resumed from the checkpoint
    saved after step 2 (in state.json, the amaxes its next roll would set) give the
    losses, amaxes and weights of the run that went on, bit for bit; a checkpoint saved
    after the calibrating step 1 too. Step 2 saturates (a projection's input times 1000), so
    the resume also carries on the guard's hold (saturation.py). A run that resumes under
    another site list calibrates afresh, and says so."""
    import train
    from checkpoint_helpers import step_state
    from picotron.checkpoint.checkpoint import load_checkpoint, save_checkpoint
    from picotron.data.windows import StepBatches, build_train_val
    path = write_config(tmp_path, "resume", ["--grad_acc_steps", "2"] + TINY)
    root = str(tmp_path / "ckpt")
    now = {"step": -1}

    def build():
        config, pgm, device = train.setup(path)
        config.training.fp8 = "tensorwise_delayed"
        built = train.build_training(config, pgm, device)
        built[0].get_submodule("layers.0.self_attn.o_proj").register_forward_pre_hook(
            lambda module, args: (args[0] * 1000, *args[1:]) if now["step"] == 1 else None)
        batches = StepBatches(build_train_val(config, str(tmp_path))[0], config, pgm, device)
        return config, pgm, device, built, batches

    def steps(run, first, last, save_after=()):
        config, pgm, device, (model, loss_fn, grads, optimizer), batches = run
        out = []
        for step in range(first, last):
            now["step"] = step
            values = train.queue_step(model, loss_fn, grads, optimizer, batches, step, config,
                                      pgm, device).read()
            loss = values["loss"]
            assert bool(values["fp8_saturated_sites"]) == (step == 1), step
            if step + 1 in save_after:
                save_checkpoint(model, optimizer, pgm, config, root, step + 1,
                                step_state(config, step + 1))
            out.append((loss, model.fp8_ledger.state()))
        return out, {n: p.detach().clone() for n, p in model.named_parameters()}

    went_on, weights = steps(build(), 0, STEPS, save_after=(1, 2))
    with open(os.path.join(root, "step_000002", "state.json")) as f:
        assert json.load(f)["fp8_amaxes"]["rolls_since_saturation"] == 0    # the hold is on
    for saved in (1, 2):
        run = build()
        load_checkpoint(os.path.join(root, f"step_{saved:06d}"), run[3][0], run[3][3], run[1],
                        run[0])
        ledger = run[3][0].fp8_ledger
        # went_on[k]: after step k + 1, whose end rolled (train.py's queue_step)
        assert not ledger.calibrating and ledger.state() == went_on[saved - 1][1]
        resumed, resumed_weights = steps(run, saved, STEPS)
        assert resumed == went_on[saved:], saved
        assert all(torch.equal(resumed_weights[n], w) for n, w in weights.items())
    run = build()                   # other sites than the checkpoint's: calibrate afresh
    ledger = run[3][0].fp8_ledger
    ledger.names = [f"other.{name}" for name in ledger.names]
    load_checkpoint(os.path.join(root, "step_000002"), run[3][0], run[3][3], run[1], run[0])
    assert ledger.calibrating
    assert "holds delayed FP8 amaxes for other projections" in capsys.readouterr().err


def reference_run(path):
    """One process, train.py's build and step, fp8 set after loading (as the worker does)."""
    from workers.fp8_delayed_worker import run
    return run(path, STEPS)


def test_every_layout_rolls_the_scales_one_process_computes(tmp_path):
    """dp2 (one micro-batch a rank) against one process accumulating the same two
    micro-batches: the same amaxes after every step, losses and final weights to fp32
    summation order; and so ZeRO-3 dp2 with accumulation (two one-sample micro-batches a
    rank: its gathers must not look like a weight change, which would roll between
    micro-batches) against one process accumulating four, tp2 (the first roll and the losses
    it feeds), pp2 (its ranks hold parts of the weights: compared through a checkpoint), and
    cp2 (its ranks hold chunks of each sequence: the first step's casts scale by the whole
    sequence's amax), eager and compiled. The controls, whose roll skips the data-parallel
    or the tensor-parallel group, or whose first step scales each cp chunk by its own amax,
    must differ. dp2's checkpoint after step 2 resumes in one process with the amaxes that
    run rolled there (its output gradients' halved), and trains on like it."""
    dp2 = write_config(tmp_path, "dp2", ["--dp", "2"] + TINY)
    zero3 = write_config(tmp_path, "zero3", ["--dp", "2", "--zero_stage", "3"] + TINY
                         + ["--mbs", "1", "--grad_acc_steps", "2"])
    one = write_config(tmp_path, "one", ["--grad_acc_steps", "2"] + TINY)
    one_by_1 = write_config(tmp_path, "one_by_1", TINY + ["--mbs", "1", "--grad_acc_steps",
                                                            "4"])
    tp2, pp2, cp2 = (write_config(tmp_path, axis, [f"--{axis[:2]}", "2", "--grad_acc_steps",
                                                   "2"] + TINY)
                     for axis in ("tp2", "pp2", "cp2"))
    cp2_compile = write_config(tmp_path, "cp2_compile", ["--cp", "2", "--grad_acc_steps", "2"]
                               + TINY + ["--set", "training.compile=true"])
    out, root = str(tmp_path / "dp2.pt"), str(tmp_path / "dp2_ckpt")
    launch_script(os.path.join(ROOT, "tests", "workers", "fp8_delayed_worker.py"), 2,
                  [dp2, out, STEPS, root, zero3, tp2, pp2, cp2, cp2_compile])
    runs = torch.load(out)
    ref = reference_run(one)
    # (reference, dy over one process's, steps compared): each rank's loss is the mean over
    # its own tokens, the gradients averaged over dp, so dp2's dy, and its scale, are 2x one
    # process's (a power of two: the same FP8 values), cp2's too (each rank's loss is the
    # mean over its chunk's tokens); tp and pp ranks see one process's dy.
    # tp2: the first roll and the losses of the two steps it feeds, not its weights. The fp32
    # summation order of its all-reduce moves a backward value across an FP8 rounding boundary
    # now and then from the first step on; Adam turns that into a visible move of the few
    # weights whose gradient is near zero (after step 1, 2 of layer 0's k_proj weights moved
    # 2.9e-4 on an AVX-512 AMD EPYC, where the test had passed on other CPUs), and by step 2
    # some dy amaxes differ by 0.3-1.6%
    layouts = {"delayed": (ref, 2, STEPS), "zero3": (reference_run(one_by_1), 2, STEPS),
               "tp2": (ref, 1, 2), "pp2": (ref, 1, STEPS), "cp2": (ref, 2, STEPS),
               "cp2 compile": (ref, 2, STEPS)}
    for layout, (want_run, dy, steps) in layouts.items():
        assert len(want_run["amaxes"][0]) >= 8         # x and dy of each projection, 2 layers
        for step, (got, want) in enumerate(zip(runs[layout]["amaxes"][:steps - 1],
                                               want_run["amaxes"])):
            assert got.keys() == want.keys(), layout
            for site, a in want.items():
                a = dy * a if site.endswith(".dy") else a
                assert got[site] == pytest.approx(a, rel=RTOL), (layout, step, site)
        assert runs[layout]["losses"][:steps] == pytest.approx(want_run["losses"][:steps],
                                                               rel=RTOL), layout
        assert runs[layout]["weights"].keys() == want_run["weights"].keys(), layout
        if steps < STEPS:               # the final weights come after steps not bounded here
            continue
        for name, w in want_run["weights"].items():
            torch.testing.assert_close(runs[layout]["weights"][name], w, rtol=RTOL, atol=RTOL,
                                       msg=f"{layout}: {name}")
    # a roll that leaves out dp, or tp; a first step that scales cp's chunks apart
    for control in ("control", "tp2 control", "cp2 control"):
        amaxes = runs[control]["amaxes"][0]
        assert any(abs(amaxes[s] - a) > 1e-3 * a for s, a in ref["amaxes"][0].items()
                   if s.endswith(".x")), control
    from workers.fp8_delayed_worker import run
    resumed = run(one, STEPS, resume=os.path.join(root, "step_000002"))
    assert resumed["loaded"].keys() == ref["amaxes"][1].keys()
    for site, a in ref["amaxes"][1].items():
        assert resumed["loaded"][site] == pytest.approx(a, rel=RTOL), site
    assert resumed["losses"] == pytest.approx(ref["losses"][2:], rel=RTOL)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], w, rtol=RTOL, atol=RTOL)


def compile_with(monkeypatch, backend):
    """training.compile's layer.compile() under `backend`, whole graphs only, for one test;
    dynamo's per-code compile counts start afresh (earlier tests compiled the same layers)."""
    torch._dynamo.reset()
    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: real_compile(
        self, **kw, backend=backend, fullgraph=True))


def built(tmp_path, name, flags, recipe="tensorwise_delayed"):
    """One process through train.py's build (TINY + `flags`, training.fp8 = `recipe`, set
    after loading: the config refuses FP8 on CPU): (model, step -> the step's StepValues)."""
    import train
    from picotron.data.windows import StepBatches, build_train_val
    config, pgm, device = train.setup(write_config(tmp_path, name, TINY + flags))
    config.training.fp8 = recipe
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    batches = StepBatches(build_train_val(config, str(tmp_path))[0], config, pgm, device)
    return model, lambda step: train.queue_step(model, loss_fn, grads, optimizer, batches, step,
                                                config, pgm, device)


def test_compiled_layers_record_and_roll_like_eager(tmp_path, monkeypatch):
    """training.compile: each layer's graph casts with its sites' A_s and records into their
    `seen` as eager does, in forward and in backward, with accumulation (4 layers, two
    micro-batches a step): the same losses, amaxes and weights, to fp32 summation order; then
    a forward without autograd of another shape (static shapes: compiled again; symbolic ones
    would reach the FP8 GEMM's out= variant, which has no shape function) gives eager's logits.
    aot_eager runs the ops the graph traced, as they are, so the comparison is tight; the
    inductor backend that training uses fuses them (other fp32 roundings, so other FP8
    roundings from there on). Records through an index into the shared buffers would rewrite
    the whole buffer from each layer's graph, losing the other layers' records."""
    compile_with(monkeypatch, "aot_eager")
    runs = []
    for compiled in (False, True):
        model, step_of = built(tmp_path, f"compile{compiled}", [
            "--grad_acc_steps", "2", "--num_hidden_layers", "4",
            "--set", f"training.compile={str(compiled).lower()}"])
        out = [(step_of(step).read()["loss"], model.fp8_ledger.state()) for step in range(STEPS)]
        with torch.no_grad():       # a validation-like forward of another shape records nothing
            logits = model(torch.arange(3 * 16).view(3, 16) % 64)
        assert not model.fp8_ledger.seen.any()      # rolled before it, and nothing recorded
        runs.append((out + [logits], {n: p.detach().clone() for n, p in model.named_parameters()}))
    (eager, eager_weights), (compiled, compiled_weights) = runs
    torch.testing.assert_close(compiled.pop(), eager.pop(), rtol=RTOL, atol=RTOL)
    assert all(amax > 0 for amax in compiled[1][1].values())      # step 1 rolled: all seen
    for (loss, amaxes), (loss_c, amaxes_c) in zip(eager, compiled):
        assert loss_c == pytest.approx(loss, rel=RTOL)
        assert amaxes_c == pytest.approx(amaxes, rel=RTOL)
    for name, w in eager_weights.items():
        torch.testing.assert_close(compiled_weights[name], w, rtol=RTOL, atol=RTOL)


def saved_for_backward(tmp_path, recipe, preset):
    """Bytes (each tensor once) that the compiled layers keep for backward in the second step
    (the delayed recipe's first step after calibrating), under the min-cut partitioner that
    inductor uses (aot_eager_decomp_partition runs its graphs' ops as they are)."""
    torch._dynamo.reset()
    _, step_of = built(tmp_path, recipe, ["--model_name", preset, "--set", "model.kernels=torch",
                                          "--set", "training.compile=true"], recipe)
    saved = {}

    def keep(t):
        saved[(t.data_ptr(), t.shape, t.dtype)] = t.numel() * t.element_size()
        return t
    for step in range(2):
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            saved.clear()
            step_of(step).read()
    return sum(saved.values())


@pytest.mark.parametrize("preset", ["debug", "debug-palm"])
def test_compiled_layers_keep_no_more_than_tensorwise(tmp_path, monkeypatch, preset):
    """q/k/v (and gate/up; in PaLM's parallel layer all five) read one x and share its delayed
    site: the compiler merges their casts as it merges tensorwise's, and keeps one x^T in FP8
    for backward. With a site each, the delayed layers kept 3 x C bytes a token more (2.8 GB
    at SmolLM-360M), and PaLM's 4 x C."""
    compile_with(monkeypatch, "aot_eager_decomp_partition")
    delayed, tensorwise = (saved_for_backward(tmp_path / preset, recipe, preset)
                           for recipe in ("tensorwise_delayed", "tensorwise"))
    assert delayed <= tensorwise, (delayed, tensorwise)
