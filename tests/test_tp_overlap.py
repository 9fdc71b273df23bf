"""distributed.tp_comm_overlap: sequence parallelism's all-gathers and reduce-scatters as rings
interleaved with the GEMMs (picotron/tensor_parallel/overlap.py), on CPU with gloo, fp32.

Layers and models (tests/workers/tp_overlap_worker.py, one launch of 4 ranks): tp = 4 and 2,
the ring column / row projections and whole two-layer models (Llama and PaLM-style, kernels
"torch" and "triton") against the same layers without overlap: outputs and every gradient
within 1e-6 relative (Frobenius norm of the difference over that of the reference). Measured:
at most 4.6e-7 (a weight gradient of the tp = 4 PaLM model, torch kernels); the ring sums the
ranks' partials in ring order, and the block's projections are one GEMM on stacked weights.

Training (one launch of 4 ranks): with overlap, dp 2 x tp 2 (Llama, "full" recomputation on
layer 0; with ZeRO-3; and with training.compile's compiled layers), tp 4 (PaLM-style, tied embeddings, "selective" recomputation),
tp 2 x pp 2 (Llama) and tp 2 x cp 2 (PaLM-style), 5 steps each, against one process with the
same global batch: loss and grad norm at every step within 1e-5 relative, final weights as
tests/test_4d.py holds them (rtol 1e-5, atol 1e-5).
"""
import os

import pytest
import torch

from launch import ROOT, final_weights, launch_many, launch_script, read_metrics, write_config
import train  # noqa: E402  (importable once launch has put the repository on sys.path)
from picotron.config import ConfigError, config_from_dict

STEPS = 5
COMMON = ["--num_hidden_layers", "2", "--num_attention_heads", "8", "--num_key_value_heads",
          "4", "--seq_len", "32", "--mbs", "2", "--total_train_steps", str(STEPS),
          "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
          "--set", "model.vocab_size=250", "--set", "dataset.name=synthetic",
          "--set", "training.learning_rate=1e-3", "--set", "training.warmup_steps=1",
          "--set", "training.max_grad_norm=1.0", "--set", "training.adam_eps=1e-6",
          "--set", f"checkpoint.save_frequency={STEPS}"]
MODELS = {"llama": [],
          "palm": ["--set", "model.parallel_residual=true", "--set", "model.norm_type=layernorm",
                   "--set", "model.tie_word_embeddings=true"]}
OVERLAP = ["--set", "distributed.sequence_parallel=true",
           "--set", "distributed.tp_comm_overlap=true"]
# (name, model, layout flags with 8 sequences a step, recomputation)
RUNS = [("dp2-tp2", "llama", ["--dp", "2", "--tp", "2", "--grad_acc_steps", "2"],
         ["--set", "training.activation_checkpointing=full",
          "--set", "training.activation_checkpointing_layers=1"]),
        ("tp4", "palm", ["--tp", "4", "--grad_acc_steps", "4"],
         ["--set", "training.activation_checkpointing=selective"]),
        ("dp2-tp2-zero3", "llama", ["--dp", "2", "--tp", "2", "--grad_acc_steps", "2",
                                    "--zero_stage", "3"], []),
        ("tp2-pp2", "llama", ["--tp", "2", "--pp", "2", "--grad_acc_steps", "4"], []),
        ("tp2-cp2", "palm", ["--tp", "2", "--cp", "2", "--grad_acc_steps", "4"], []),
        ("dp2-tp2-compile", "llama", ["--dp", "2", "--tp", "2", "--grad_acc_steps", "2"],
         ["--set", "training.compile=true"])]
LOSS_RTOL = 1e-5


def test_layers_and_models_match_the_non_overlapped_path():
    proc = launch_script(os.path.join(ROOT, "tests", "workers", "tp_overlap_worker.py"), 4)
    assert "largest relative error" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (overlapped run's config, one-process reference's config)}: the overlapped
    runs in one launch of 4 ranks, the references (one per model) in this process."""
    root = tmp_path_factory.mktemp("tp_overlap")
    refs = {model: write_config(root, f"ref-{model}", COMMON + MODELS[model]
                                + ["--grad_acc_steps", "4"]) for model in MODELS}
    paths = {name: (write_config(root, name, COMMON + MODELS[model] + layout + OVERLAP
                                 + recompute), refs[model])
             for name, model, layout, recompute in RUNS}
    launch_many([run for run, _ in paths.values()], 4)
    threads = torch.get_num_threads()         # one process, on one thread, like the ranks
    torch.set_num_threads(1)
    try:
        for ref in refs.values():
            train.main(["--config", ref])
    finally:
        torch.set_num_threads(threads)
    return paths


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_training_matches_one_process(runs, name):
    path, ref = runs[name]
    metrics, ref_metrics = read_metrics(path), read_metrics(ref)
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(
        range(1, STEPS + 1))
    for got, want in zip(metrics, ref_metrics):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=LOSS_RTOL), got["step"]
    weights, ref_weights = final_weights(path), final_weights(ref)
    assert weights.keys() == ref_weights.keys()
    for key, want in ref_weights.items():
        torch.testing.assert_close(weights[key], want, rtol=1e-5, atol=1e-5, msg=key)


def config_error(distributed, model=None, training=None) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"distributed": distributed, "model": model or {},
                          "training": training or {}})
    return str(e.value)


def test_config_refuses_what_the_overlap_cannot_run():
    tp2 = {"tp_size": 2, "tp_comm_overlap": True}
    assert "sequence_parallel is false" in config_error(tp2)
    sp = {**tp2, "sequence_parallel": True}
    assert "model.kernels='liger'" in config_error(sp, {"kernels": "liger"})
    assert "training.fp8='tensorwise'" in config_error(
        sp, training={"fp8": "tensorwise", "dtype": "bfloat16"})
    config_from_dict({"distributed": sp, "model": {}, "training": {}})
    # tp 1: nothing to overlap, accepted as a no-op (like sequence_parallel itself)
    config_from_dict({"distributed": {"tp_comm_overlap": True, "sequence_parallel": True},
                      "model": {}, "training": {}})
