"""training.cuda_graphs trains exactly like the eager layers (skipped without CUDA; the
data-parallel case needs 2 GPUs).

A replayed graph launches the very kernels the eager step launched, on the same inputs, so the
two runs should agree to the last bit; the tolerance (1e-6 relative) only leaves room for
cuBLAS choosing another algorithm for the captured stream. Each run trains 6 steps of 2
micro-batches (the graph is replayed 12 times, its static inputs overwritten each time), with
validation in eval mode every 3 steps (the eager layers run there, and training goes back to
the graph after), through train.py's own main. Compared: every step's loss and gradient norm,
the validation losses and the final weights. Our Triton kernels (model.kernels=triton) and the
readable ones, in fp32 and bf16; our kernels with "selective" recomputation; fp16 with loss
scaling; FP8 GEMMs (tensorwise and rowwise); the PaLM-style block; a run resumed under
graphs; and dp=2 over NCCL with ZeRO stages
0 and 2, where the gradient hooks (bucket all-reduce or reduce-scatter) fire after the
backward graph. (measured: see bench/NOTES.md)
"""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import ROOT, final_weights, launch, read_metrics  # noqa: E402

sys.path.insert(0, ROOT)
import create_config  # noqa: E402
import train  # noqa: E402


def train_run(tmp_path, name, kernels, dtype, graphs, dp=1, zero=0, ckpt="none", fp8="auto",
              save_every=6, model="debug"):
    path = create_config.main([
        "--out_dir", str(tmp_path), "--exp_name", name, "--model_name", model,
        "--mbs", "4", "--seq_len", "128",
        "--dp", str(dp), "--zero_stage", str(zero),
        "--grad_acc_steps", "2", "--total_train_steps", "6", "--use_fused_adam",
        "--set", f"model.kernels={kernels}", "--set", f"training.dtype={dtype}",
        "--set", f"training.master_weights={'false' if dtype == 'bfloat16' else 'true'}",
        "--set", f"training.cuda_graphs={'true' if graphs else 'false'}",
        "--set", f"training.activation_checkpointing={ckpt}", "--set", f"training.fp8={fp8}",
        "--set", "training.val_frequency=3", "--set", "dataset.val_samples=8",
        "--set", f"checkpoint.save_frequency={save_every}"])
    if dp == 1:
        train.main(["--config", path])
    else:           # torchrun, NCCL: the reductions run from hooks after the backward graph
        launch(path, dp)
    return read_metrics(path), final_weights(path)


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def compare(tmp_path, kernels, dtype, dp=1, zero=0, ckpt="none", fp8="auto", model="debug"):
    (eager, eager_w), (graphed, graphed_w) = (
        train_run(tmp_path, f"{model}_{kernels}_{dtype}_{dp}_{zero}_{ckpt}_{fp8}_{g}", kernels,
                  dtype, g, dp, zero, ckpt, fp8, model=model)
        for g in (False, True))
    steps = [r for r in eager if "loss" in r]
    assert len(steps) == 6 and len([r for r in eager if "val_loss" in r]) == 2
    diffs = {key: rel([r[key] for r in graphed if key in r], [r[key] for r in eager if key in r])
             for key in ("loss", "grad_norm", "val_loss")}
    diffs["weights"] = max(rel(graphed_w[n].float(), w.float()) for n, w in eager_w.items())
    print(f"cuda_graphs vs eager, {kernels} {dtype} dp{dp} zero{zero} fp8 {fp8}: relative "
          f"differences "
          f"{diffs}")
    assert all(d <= 1e-6 for d in diffs.values()), diffs
    assert steps[-1]["loss"] < steps[0]["loss"]          # it trained


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_layers_train_like_eager_layers(tmp_path, kernels, dtype):
    compare(tmp_path, kernels, dtype)


def test_graphed_layers_with_recomputed_swiglu(tmp_path):
    """activation_checkpointing=selective with our kernels: the MLP's autograd function keeps
    gu and recomputes the SwiGLU output in its backward, inside the captured graph."""
    compare(tmp_path, "triton", "bfloat16", ckpt="selective")


def test_graphed_layers_with_fp16_loss_scaling(tmp_path):
    """fp16 with dynamic loss scaling: the scaled loss's gradient flows through the backward
    graph and is unscaled after it, as in the eager run."""
    compare(tmp_path, "torch", "float16")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
@pytest.mark.parametrize("kernels,ckpt,fp8", [("triton", "selective", "tensorwise"),
                                              ("triton", "selective", "rowwise"),
                                              ("torch", "none", "tensorwise"),
                                              ("triton", "selective", "tensorwise_delayed"),
                                              ("torch", "none", "tensorwise_delayed")])
def test_graphed_fp8_layers(tmp_path, kernels, ckpt, fp8):
    """training.fp8: the weights' FP8 copies recast in place before a replay when the
    optimizer (or validation's eager forward after it) changed them; the activations' casts
    and scales inside the graphs. "tensorwise_delayed": the calibrating first step eager, the
    capture at step 2, the amaxes rolled in place between replays."""
    compare(tmp_path, kernels, "bfloat16", ckpt=ckpt, fp8=fp8)


@pytest.mark.parametrize("fp8", ["none", "tensorwise", "tensorwise_delayed"])
def test_graphed_palm_layers(tmp_path, fp8):
    """The PaLM-style block (one shared LayerNorm, attention and MLP in parallel, multi-query,
    tied embeddings: the debug-palm preset), which training.cuda_graphs="auto" captures too."""
    if fp8 != "none" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    compare(tmp_path, "triton", "bfloat16", ckpt="selective", fp8=fp8, model="debug-palm")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
@pytest.mark.parametrize("fp8", ["tensorwise", "tensorwise_delayed"])
def test_a_graphed_run_resumes_like_the_run_that_went_on(tmp_path, fp8):
    """A checkpoint loads into the parameters in place, under graphs captured before it (and
    the FP8 weight copies recast from it): steps 4-6 resumed from the step-3 checkpoint give
    the losses and final weights of the run that went on, bit for bit. Delayed scaling: the
    amaxes come back from the checkpoint, so the resumed run captures at its first step."""
    import json
    import shutil
    _, straight_w = train_run(tmp_path, "straight", "triton", "bfloat16", True,
                              ckpt="selective", fp8=fp8, save_every=3)
    straight = tmp_path / "straight"
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_000003",
                    resumed / "checkpoints" / "step_000003")
    raw = json.loads((straight / "config.json").read_text())
    raw["checkpoint"]["load_path"] = "latest"
    (resumed / "config.json").write_text(json.dumps(raw))
    train.main(["--config", str(resumed / "config.json")])
    a = {r["step"]: r["loss"] for r in read_metrics(str(straight / "config.json")) if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(str(resumed / "config.json")) if "loss" in r}
    assert sorted(b) == [4, 5, 6] and all(b[i] == a[i] for i in b), (a, b)
    resumed_w = final_weights(str(resumed / "config.json"))
    assert all(torch.equal(straight_w[n], resumed_w[n]) for n in straight_w)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("zero", [0, 2])
def test_graphed_layers_under_data_parallel(tmp_path, zero):
    """dp=2 over NCCL: the same comparison, both runs on 2 GPUs."""
    compare(tmp_path, "triton", "bfloat16", dp=2, zero=zero)
