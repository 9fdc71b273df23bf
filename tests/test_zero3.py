"""ZeRO-3 (picotron/data_parallel/zero3.py) trains exactly like one process, in every layout
it composes with, moves checkpoints to and from other ZeRO stages and layouts, and holds 1/N of
the parameters.

Three launches: 4 gloo ranks (the dp x tp / pp / cp layouts, the first part of a checkpoint
move, then the memory measurement), 1 process (the references and the move's middle part), 2
ranks (dp2, the move's last part, which resumes the 1-process checkpoint at ZeRO-3, fp16 loss
scaling, Hugging Face weights loaded into the shards).
"""
import json
import os

import pytest
import torch

import create_config
from picotron.config import ConfigError, config_from_dict
from picotron.checkpoint.hf_io import export_hf
from launch import ROOT, final_weights, launch_many, launch_script, read_metrics, write_config
from test_4d import FLAT, STEPS, TINY, assert_same_losses, assert_same_weights

# name: (dp, tp, pp, cp, micro-batch size, accumulation, reference, extra flags). The global
# batch is 8 sequences in every run. Each composition rides on one layout: recomputation and
# CPU offload of AdamW, sequence parallelism, the three pipeline schedules with a tied
# embedding (summed across the pipeline's ends), parameters kept from forward to backward.
REFS = {"debug": [], "tied": ["--set", "model.tie_word_embeddings=true"],
        "palm": ["--model_name", "debug-palm"]}
RUNS = {
    "dp4": (4, 1, 1, 1, 2, 1, "debug", []),
    "dp4-acc": (4, 1, 1, 1, 1, 2, "debug", [
        "--set", "distributed.offload_optim_frac=0.5",
        "--set", "training.activation_checkpointing=selective"]),
    "2x2x1x1": (2, 2, 1, 1, 4, 1, "debug", []),
    "2x2x1x1-acc": (2, 2, 1, 1, 2, 2, "debug", [
        "--set", "distributed.sequence_parallel=true",
        "--set", "training.activation_checkpointing=full"]),
    "2x1x2x1": (2, 1, 2, 1, 4, 1, "tied", ["--pp_engine", "afab",
                                            "--set", "distributed.zero3_keep_params=true"]),
    "2x1x2x1-acc": (2, 1, 2, 1, 2, 2, "tied", ["--pp_engine", "interleaved"]),
    "2x1x2x1-1f1b": (2, 1, 2, 1, 1, 4, "debug", ["--pp_engine", "1f1b"]),
    "2x1x1x2": (2, 1, 1, 2, 4, 1, "debug", []),
    "2x1x1x2-acc": (2, 1, 1, 2, 2, 2, "palm", []),
    "dp2": (2, 1, 1, 1, 4, 1, "debug", []),
    "dp2-acc": (2, 1, 1, 1, 2, 2, "debug", ["--set", "distributed.overlap_grad_reduce=false"]),
    "dp1": (1, 1, 1, 1, 2, 4, "debug", []),
}
# fp16 with dynamic loss scaling, started at a scale that overflows (the first steps are
# skipped and the scale halved), at ZeRO-3 and at ZeRO-2: the same arithmetic (one
# micro-batch: each gradient summed in fp32 and reduce-scattered once), so the same records.
# Clipping is off: the norm's per-bucket sums are added in another order (ZeRO-3 has one
# bucket per layer), so its last bit may differ, and a clip coefficient would carry that bit
# into the weights; unclipped, the updates do not read the norm and stay bit-identical.
FP16 = ["--set", "training.dtype=float16", "--set", "training.initial_loss_scale=4194304",
        "--set", "training.max_grad_norm=0", "--total_train_steps", "10"] + TINY
# A checkpoint's journey: 3 steps at ZeRO-3 dp4, 3 more at ZeRO-0 in one process, 3 more at
# ZeRO-3 dp2; every loss and the final weights equal the uninterrupted one-process run.
MOVES = [("part0", (4, 1, 1, 1, 2, 1), 3, 3), ("part1", (1, 1, 1, 1, 2, 4), 0, 6),
         ("part2", (2, 1, 1, 1, 2, 2), 3, 9)]


def flags(dp, tp, pp, cp, mbs, acc, zero=3):
    return ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--mbs",
            str(mbs), "--grad_acc_steps", str(acc), "--zero_stage", str(zero)]


def write_configs(root) -> dict:
    """{name: config path} of every training of this file, under `root`."""
    paths = {f"ref-{k}": write_config(root, f"ref-{k}", TINY + extra + [
        "--total_train_steps", str(STEPS)] + flags(1, 1, 1, 1, 2, 4, zero=0))
        for k, extra in REFS.items()}
    for name, (*layout, ref, extra) in RUNS.items():
        paths[name] = write_config(root, name, TINY + REFS[ref] + extra + [
            "--total_train_steps", str(STEPS)] + flags(*layout))
    previous = None
    for name, layout, zero, total in MOVES:
        resume = [] if previous is None else ["--set", f"checkpoint.load_path={previous}"]
        paths[name] = write_config(root, name, TINY + FLAT + resume + [
            "--total_train_steps", str(total)] + flags(*layout, zero=zero))
        previous = os.path.join(root, name, "checkpoints", f"step_{total:06d}")
    paths["whole"] = write_config(root, "whole", TINY + FLAT + ["--total_train_steps", "9"]
                                  + flags(1, 1, 1, 1, 2, 4, zero=0))
    paths["memory"] = write_config(root, "memory", TINY + ["--total_train_steps", "1"]
                                   + flags(4, 1, 1, 1, 2, 1))
    for zero in (2, 3):
        paths[f"fp16-zero{zero}"] = write_config(root, f"fp16-zero{zero}", FP16 + flags(
            2, 1, 1, 1, 4, 1, zero=zero))
    paths["memory.json"] = os.path.join(root, "memory.json")
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3")
    paths = write_configs(root)
    four = [n for n, r in RUNS.items() if r[0] * r[1] * r[2] * r[3] == 4] + ["part0"]
    script = os.path.join(ROOT, "tests", "workers", "zero3_worker.py")
    launch_script(script, 4, [paths["memory.json"], paths["memory"]]
                  + [paths[n] for n in four], timeout=1200)
    launch_many([paths[n] for n in ["ref-debug", "ref-tied", "ref-palm", "dp1", "part1",
                                    "whole"]], 1)
    # Hugging Face weights (the one-process reference's, exported) loaded at ZeRO-3 and ZeRO-0
    hf = export_hf(os.path.join(root, "ref-debug", "checkpoints", f"step_{STEPS:06d}"),
                   os.path.join(root, "hf"))
    for zero in (0, 3):
        paths[f"init-zero{zero}"] = write_config(root, f"init-zero{zero}", TINY + [
            "--total_train_steps", "3", "--set", f"checkpoint.init_from={hf}"]
            + flags(2, 1, 1, 1, 4, 1, zero=zero))
    launch_many([paths[n] for n in ["dp2", "dp2-acc", "part2", "fp16-zero2", "fp16-zero3",
                                    "init-zero0", "init-zero3"]], 2)
    return paths


@pytest.mark.parametrize("name", list(RUNS))
def test_zero3_matches_single_process(runs, name):
    """Loss and grad norm at every step, the validation loss, the final weights: 1e-5."""
    path, ref = runs[name], runs[f"ref-{RUNS[name][6]}"]
    assert_same_losses(read_metrics(ref), read_metrics(path), list(range(1, STEPS + 1)))
    val_ref, val_run = ([r["val_loss"] for r in read_metrics(p) if "val_loss" in r]
                        for p in (ref, path))
    assert len(val_ref) == 1 and val_run == pytest.approx(val_ref, rel=1e-5)
    assert_same_weights(ref, path)


def test_checkpoints_move_between_zero3_and_zero0(runs):
    whole = read_metrics(runs["whole"])
    for name, _, _, total in MOVES:
        part = [r for r in read_metrics(runs[name]) if "loss" in r and r["step"] > total - 3]
        assert_same_losses(whole, part, list(range(total - 2, total + 1)))
    assert_same_weights(runs["whole"], runs["part2"])


def test_each_rank_holds_a_quarter_of_the_parameters(runs):
    """After a step at dp4 each rank's parameter storage is 1/4 of the model's, plus at most
    one element of padding per flat buffer; during the step at most two layers are whole (the
    one running and the next one's gather), never the whole model."""
    for rank in range(4):
        with open(f"{runs['memory.json']}.{rank}") as f:
            m = json.load(f)
        quarter = m["model_bytes"] / 4
        assert quarter <= m["held_bytes"] < quarter + 4 * m["buckets"], m
        assert m["gathered_after_step"] == 0, m
        assert 1 <= m["max_gathered_layers"] <= 2 < m["layers"], m


def test_fp16_loss_scaling_at_zero3_is_zero2s(runs):
    zero2, zero3 = ([r for r in read_metrics(runs[f"fp16-zero{z}"]) if "loss" in r]
                    for z in (2, 3))
    skipped = [r["skipped"] for r in zero3]
    assert skipped[0] and not skipped[-1], skipped        # overflowed, then trained
    keys = ("step", "loss", "skipped", "loss_scale")
    assert [[r[k] for k in keys] for r in zero3] == [[r[k] for k in keys] for r in zero2]
    # A skipped step's norm is not finite and is written as null: both runs say so, at the
    # same steps. The others are the fp32 norm of the unscaled gradients (a missing unscale
    # would show as a factor of the loss scale), summed in another order.
    norms2, norms3 = ([r["grad_norm"] for r in run] for run in (zero2, zero3))
    assert [n is None for n in norms3] == [n is None for n in norms2] == skipped
    assert ([n for n in norms3 if n is not None]
            == pytest.approx([n for n in norms2 if n is not None], rel=1e-5))
    w2, w3 = (final_weights(runs[f"fp16-zero{z}"]) for z in (2, 3))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)


def test_hugging_face_weights_load_into_the_shards(runs):
    zero0, zero3 = (read_metrics(runs[f"init-zero{z}"]) for z in (0, 3))
    assert_same_losses(zero0, zero3, [1, 2, 3])
    assert_same_weights(runs["init-zero0"], runs["init-zero3"])
    drawn = read_metrics(runs["dp2"])            # the same batches from the initial draw
    assert zero3[0]["loss"] < drawn[0]["loss"] - 0.1, (zero3[0], drawn[0])


def test_cuda_graphs_are_refused_at_zero3():
    with pytest.raises(ConfigError, match="zero_stage=3 gathers and frees"):
        config_from_dict({"distributed": {"zero_stage": 3}, "training": {"cuda_graphs": True}})


@pytest.mark.parametrize("flags,words", [
    (["--set", "training.compile=true"], ["zero_stage=3", "training.compile=false"]),
    (["--set", "distributed.zero3_keep_params=true", "--zero_stage", "1"],
     ["zero3_keep_params", "zero_stage=1"]),
])
def test_what_zero3_cannot_do_is_refused(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_info:
        create_config.main(["--out_dir", str(tmp_path), "--exp_name", "bad", "--use_cpu",
                            "--zero_stage", "3"] + flags)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert all(word in message for word in words), message
