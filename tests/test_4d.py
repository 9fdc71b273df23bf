"""Every layout trains like one process, and checkpoints move between layouts.

LAYOUTS below is the parity matrix (8 gloo ranks each); the table of proven layouts in README
and docs/layouts.md is rendered from it: `python tests/test_4d.py` prints the table, and a test
checks that both pages hold exactly that text.
"""
import os
import sys

import pytest
import torch

from launch import ROOT, final_weights, launch_many, read_metrics, write_config

# (dp, tp, pp, cp, model preset, pp_engine, zero_stage, sequence_parallel). PaLM-style models
# use multi-query attention (one kv head), which tensor parallelism cannot split: tp = 1 there.
LAYOUTS = [
    (2, 2, 2, 1, "debug", "1f1b", 1, False),
    (2, 1, 2, 2, "debug-palm", "interleaved", 0, False),
    (1, 2, 2, 2, "debug", "interleaved", 0, True),
    (2, 2, 1, 2, "debug", "1f1b", 1, True),
    (1, 2, 1, 4, "debug", "1f1b", 0, False),
    (1, 1, 2, 4, "debug-palm", "1f1b", 1, False),
    (8, 1, 1, 1, "debug-palm", "1f1b", 1, False),
]
GLOBAL_BATCH = 8        # sequences per step in every run: mbs * grad_acc * dp
STEPS = 5
# Validation after step 5 on 5 held-out windows: with mbs 2 a replica's last validation
# micro-batch is ragged (1 window), and dp 8 leaves some replicas none.
# A tiny model: 4 layers so that interleaved pp 2 has 2 virtual stages of 1 layer each. Adam's
# eps at 1e-6 instead of 1e-8: elements whose gradient is ~1e-8 (summed in another order by
# another layout) would otherwise turn rounding noise into full-size updates.
TINY = ["--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "4", "--seq_len", "32", "--learning_rate", "1e-3",
        "--set", "training.warmup_steps=2", "--set", "training.adam_eps=1e-6",
        "--set", "checkpoint.save_frequency=100", "--set", "distributed.timeout_s=120",
        "--set", "training.val_frequency=5", "--set", "dataset.val_samples=5"]


def layout_flags(dp, tp, pp, cp, engine="1f1b", zero=0, sp=False):
    mbs = 1 if dp == 8 else 2
    acc = GLOBAL_BATCH // (mbs * dp)
    return ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp),
            "--pp_engine", engine, "--zero_stage", str(zero), "--mbs", str(mbs),
            "--grad_acc_steps", str(acc), "--set", f"distributed.sequence_parallel={str(sp).lower()}"]


def name(layout) -> str:
    dp, tp, pp, cp, model, engine, zero, sp = layout
    return f"{dp}x{tp}x{pp}x{cp}-{model}-{engine}-zero{zero}" + ("-sp" if sp else "")


def readme_table() -> str:
    rows = ["| dp x tp x pp x cp | model | pp engine | ZeRO | sequence parallel |",
            "|---|---|---|---|---|"]
    for dp, tp, pp, cp, model, engine, zero, sp in LAYOUTS:
        rows.append(f"| {dp}x{tp}x{pp}x{cp} | {model} | {engine if pp > 1 else '-'} | {zero} | "
                    f"{'yes' if sp else 'no'} |")
    return "\n".join(rows) + "\n"


# test_checkpoint_moves_between_layouts: 3 steps as 2x2x2x1 (ZeRO-1), 3 more as
# 1x4x2x1 from that checkpoint, 3 more in one process. Constant learning rate, so the schedule
# does not depend on where a run stops. The first two parts also recompute activations
# (training.activation_checkpointing "full" on layer 0, "selective" on layers 0-1), which must
# change no number: recomputation composed with tp's collectives, pp's stages and dp.
MOVES = [((2, 2, 2, 1), 3), ((1, 4, 2, 1), 6), ((1, 1, 1, 1), 9)]
RECOMPUTE = [["--set", "training.activation_checkpointing=full",
              "--set", "training.activation_checkpointing_layers=1"],
             ["--set", "training.activation_checkpointing=selective",
              "--set", "training.activation_checkpointing_layers=2"], []]
FLAT = ["--set", "training.warmup_steps=0", "--set", "training.min_lr_ratio=1.0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training of this file, in two launches (tests/workers/train_many.py: one
    train.main after another, the start-up paid once): the 8-rank ones, then the one-process
    ones, which include the references (the same global batch by accumulation) and the last
    part of the checkpoint move. Returns {name: config path}."""
    root = tmp_path_factory.mktemp("4d")
    paths = {name(lay): write_config(root, name(lay), TINY + [
        "--model_name", lay[4], "--total_train_steps", str(STEPS)]
        + layout_flags(*lay[:4], *lay[5:])) for lay in LAYOUTS}
    for model in ("debug", "debug-palm"):
        paths[f"ref-{model}"] = write_config(root, f"ref-{model}", TINY + [
            "--model_name", model, "--total_train_steps", str(STEPS)] + layout_flags(1, 1, 1, 1))
    previous = None
    for i, (layout, total) in enumerate(MOVES):
        extra = [] if previous is None else ["--set", f"checkpoint.load_path={previous}"]
        paths[f"part{i}"] = write_config(root, f"part{i}", TINY + FLAT + extra + RECOMPUTE[i]
                                         + ["--total_train_steps", str(total)]
                                         + layout_flags(*layout, zero=int(i == 0)))
        previous = os.path.join(root, f"part{i}", "checkpoints", f"step_{total:06d}")
    paths["whole"] = write_config(root, "whole", TINY + FLAT + ["--total_train_steps", "9"]
                                  + layout_flags(1, 1, 1, 1))
    launch_many([paths[name(lay)] for lay in LAYOUTS] + [paths["part0"], paths["part1"]], 8)
    launch_many([paths[k] for k in ("ref-debug", "ref-debug-palm", "part2", "whole")], 1)
    return paths


def assert_same_losses(ref, run, steps):
    ref, run = ([r for r in records if "loss" in r] for records in (ref, run))   # training
    assert [r["step"] for r in run] == steps
    by_step = {r["step"]: r for r in ref}
    for r in run:
        assert r["loss"] == pytest.approx(by_step[r["step"]]["loss"], rel=1e-5), r["step"]
        assert r["grad_norm"] == pytest.approx(by_step[r["step"]]["grad_norm"], rel=1e-5)


def assert_same_weights(ref_path, run_path):
    w_ref, w_run = final_weights(ref_path), final_weights(run_path)
    assert w_ref.keys() == w_run.keys()
    for key in w_ref:
        # atol 1e-5 is 1% of one step's update at lr 1e-3: a missing reduction, a wrong
        # slice or a stale shard moves weights by ~1e-3.
        torch.testing.assert_close(w_run[key], w_ref[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[name(lay) for lay in LAYOUTS])
def test_layout_matches_single_process(runs, layout):
    path, ref = runs[name(layout)], runs[f"ref-{layout[4]}"]
    assert_same_losses(read_metrics(ref), read_metrics(path), list(range(1, STEPS + 1)))
    # the validation loss after the last step: through the pipeline when pp > 1
    val_ref, val_run = ([r["val_loss"] for r in read_metrics(p) if "val_loss" in r]
                        for p in (ref, path))
    assert len(val_ref) == 1 and val_run == pytest.approx(val_ref, rel=1e-5)
    assert_same_weights(ref, path)


def test_checkpoint_moves_between_layouts(runs):
    """MOVES: every loss equals the uninterrupted single-process run, and so do the weights."""
    ref = read_metrics(runs["whole"])
    for i, (layout, total) in enumerate(MOVES):
        part = read_metrics(runs[f"part{i}"])
        assert_same_losses(ref, [r for r in part if "loss" in r and r["step"] > total - 3],
                           list(range(total - 2, total + 1)))
    assert_same_weights(runs["whole"], runs["part2"])


def test_readme_lists_the_proven_layouts():
    for page in ("README.md", os.path.join("docs", "layouts.md")):
        with open(os.path.join(ROOT, page)) as f:
            assert readme_table() in f.read(), f"{page}'s table stale: run python tests/test_4d.py"


if __name__ == "__main__":
    sys.stdout.write(readme_table())
