"""Tensor parallelism against one process (CPU, gloo, fp32).

Layers: column, row, vocab embedding and the vocab-parallel loss against their unsharded
versions (tests/tp_layers_worker.py). Training: tp = 2 and 4, with and without sequence
parallelism, tied and untied, Llama and PaLM-style, against the same config run with tp = 1:
loss and clipped-grad norm at every step, final gathered weights. The vocabulary is 250, padded
to 252 under tp = 4. Config checks: layouts TP cannot run are refused at load time.
"""
import os

import pytest
import torch

from launch import ROOT, final_weights, launch_many, launch_script, read_metrics, write_config
import train  # noqa: E402  (importable once launch has put the repository on sys.path)
from picotron.config import ConfigError, config_from_dict

STEPS = 5
# Tiny model: 8 query heads, 4 kv heads (GQA), so tp = 4 leaves 2 query and 1 kv head a rank.
# max_grad_norm 1.0 is below the norms of these steps (~1.2-1.3): clipping acts every step.
# Final weights go through AdamW, whose update lr*m/(sqrt(v)+eps) is ill-conditioned where a
# gradient is near zero: a few elements of these runs have step-1 gradients ~5e-8 (median
# ~3e-3), and fp32 rounding of their sums, which differs with any change of summation order,
# moves them by up to ~1e-2*lr. Hence weights are held to torch.testing's fp32 tolerance
# (atol 1e-5 = 1e-2*lr), and adam_eps is 1e-6 rather than 1e-8 to keep those few elements
# further from that edge. Loss and grad norm, which see no optimizer, are held to 1e-5.
COMMON = ["--num_hidden_layers", "2", "--num_attention_heads", "8", "--num_key_value_heads",
          "4", "--seq_len", "32", "--mbs", "2", "--grad_acc_steps", "2",
          "--total_train_steps", str(STEPS),
          "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
          "--set", "model.vocab_size=250", "--set", "dataset.name=synthetic",
          "--set", "training.learning_rate=1e-3", "--set", "training.warmup_steps=1",
          "--set", "training.max_grad_norm=1.0", "--set", "training.adam_eps=1e-6",
          "--set", f"checkpoint.save_frequency={STEPS}"]
ARCH = {"llama": [], "palm": ["--set", "model.parallel_residual=true",
                              "--set", "model.norm_type=layernorm"]}
# A covering set: every pair of values of (tp, sp, tied, arch) occurs in some case.
CASES = [(4, False, False, "llama"), (4, True, True, "palm"), (2, False, True, "palm"),
         (2, True, False, "palm"), (2, True, True, "llama")]
LOSS_RTOL = 1e-5        # fp32, only the order of the sums differs
WEIGHT_TOL = dict(rtol=1.3e-6, atol=1e-5)   # torch.testing's fp32 default


def model_args(tied: bool, arch: str) -> list:
    return COMMON + ARCH[arch] + ["--set", f"model.tie_word_embeddings={str(tied).lower()}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tp = 1 run of a (tied, arch) model, run once and shared by the cases."""
    runs = {}

    def get(tied: bool, arch: str):
        if (tied, arch) not in runs:
            path = write_config(tmp_path_factory.mktemp("ref"), f"tp1-{arch}-tied{tied}",
                                model_args(tied, arch))
            threads = torch.get_num_threads()     # one process, in this one, on one thread
            torch.set_num_threads(1)              # like the launched ranks (OMP_NUM_THREADS=1)
            try:
                train.main(["--config", path])
            finally:
                torch.set_num_threads(threads)
            runs[(tied, arch)] = (read_metrics(path), final_weights(path))
        return runs[(tied, arch)]
    return get


def test_layers_match_unsharded():
    """Column, row (with and without SP), vocab embedding, vocab head + loss (V = 13: padded);
    tp = 2 here, tp = 4 in the training cases."""
    launch_script(os.path.join(ROOT, "tests", "tp_layers_worker.py"), 2)


IDS = [f"tp{tp}-{'sp' if sp else 'nosp'}-{'tied' if tied else 'untied'}-{arch}"
       f"{'-padded_vocab' if 250 % tp else ''}" for tp, sp, tied, arch in CASES]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Every case's config path by id, trained in one launch per tp size (launch_many)."""
    root, paths, by_tp = tmp_path_factory.mktemp("tp"), {}, {}
    for case_id, (tp, sp, tied, arch) in zip(IDS, CASES):
        paths[case_id] = write_config(root, case_id, model_args(tied, arch) + [
            "--tp", str(tp), "--set", f"distributed.sequence_parallel={str(sp).lower()}"])
        by_tp.setdefault(tp, []).append(paths[case_id])
    for tp, configs in by_tp.items():
        launch_many(configs, tp)
    return paths


@pytest.mark.parametrize("tp,sp,tied,arch", CASES, ids=IDS)
def test_training_matches_tp1(tp_runs, reference, tp, sp, tied, arch):
    ref_metrics, ref_weights = reference(tied, arch)
    path = tp_runs[IDS[CASES.index((tp, sp, tied, arch))]]
    metrics = read_metrics(path)
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(
        range(1, STEPS + 1))
    for got, want in zip(metrics, ref_metrics):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=LOSS_RTOL), got["step"]
    weights = final_weights(path)
    assert weights.keys() == ref_weights.keys()      # full names, unpadded shapes
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, **WEIGHT_TOL,
                                   msg=lambda m: f"{name}: {m}")


def config_error(**distributed_and_model) -> str:
    raw = {"distributed": {}, "model": {}, "training": {}}
    for key, value in distributed_and_model.items():
        section = "training" if key == "seq_length" else (
            "distributed" if key in ("tp_size", "cp_size", "sequence_parallel") else "model")
        raw[section][key] = value
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    return str(e.value)


def test_config_refuses_what_tp_cannot_run():
    assert "num_key_value_heads=2 is not divisible by tp_size=4" in config_error(
        tp_size=4, num_attention_heads=8, num_key_value_heads=2)
    assert "not divisible by cp_size*tp_size=4" in config_error(
        tp_size=4, sequence_parallel=True, seq_length=66)
    assert "leaves the last TP rank no rows" in config_error(tp_size=4, vocab_size=9,
                                                             num_attention_heads=4,
                                                             num_key_value_heads=4)
    config_from_dict({"distributed": {"tp_size": 4}, "model": {"vocab_size": 250,
                      "num_attention_heads": 4, "num_key_value_heads": 4}})   # padded: fine
