"""Data parallelism and ZeRO against one process; overlap and memory measured for real."""
import json
import os
import subprocess
import sys

import pytest
import torch

from launch import (ROOT, final_weights, launch, launch_many, launch_script, read_metrics,
                    write_config)
from picotron.data_parallel.loss_scaler import DynamicLossScaler

TINY = ["--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "2", "--seq_len", "32", "--mbs", "2", "--total_train_steps", "5",
        "--set", "training.warmup_steps=2", "--set", "checkpoint.save_frequency=5",
        "--set", "distributed.bucket_size_mb=0.05", "--learning_rate", "1e-3"]
# (dp, grad_acc, zero_stage, extra flags): each runs against one process with the same
# global batch, mbs * grad_acc * dp sequences, reached by accumulation alone.
OFFLOAD = ["--set", "distributed.offload_optim_frac=0.5"]
PALM = ["--model_name", "debug-palm"]
CASES = [(2, 1, 0, []), (2, 3, 0, []), (2, 1, 1, []), (2, 3, 2, []),
         (4, 1, 2, []), (4, 3, 1, []), (4, 1, 0, OFFLOAD), (2, 1, 1, PALM)]


def assert_same_run(ref_path, run_path):
    ref, run = read_metrics(ref_path), read_metrics(run_path)
    assert len(ref) == len(run) == 5
    for a, b in zip(ref, run):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    w_ref, w_run = final_weights(ref_path), final_weights(run_path)
    assert w_ref.keys() == w_run.keys()
    for name in w_ref:
        # fp32, 5 AdamW steps at lr 1e-3: a reordered sum moves a weight by ~1e-8
        torch.testing.assert_close(w_run[name], w_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def case_name(dp, acc, zero, extra):
    return f"dp{dp}-acc{acc}-zero{zero}" + ("-palm" if extra is PALM else "") + (
        "-offload" if extra is OFFLOAD else "")


def reference_name(dp, acc, extra):
    """Single-process runs, one per (micro-batches per step, model), shared between cases."""
    return f"ref-acc{acc * dp}" + ("-palm" if extra is PALM else "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case and its reference, one launch per world size (tests/launch.py launch_many).
    Returns {name: config path}."""
    root, paths, by_world = tmp_path_factory.mktemp("dp"), {}, {}
    for dp, acc, zero, extra in CASES:
        ref = reference_name(dp, acc, extra)
        if ref not in paths:     # the same global batch in one process, accumulated
            paths[ref] = write_config(root, ref, TINY + (extra if extra is PALM else []) +
                                      ["--grad_acc_steps", str(acc * dp)])
            by_world.setdefault(1, []).append(paths[ref])
        key = case_name(dp, acc, zero, extra)
        paths[key] = write_config(root, key, TINY + extra + [
            "--grad_acc_steps", str(acc), "--dp", str(dp), "--zero_stage", str(zero)])
        by_world.setdefault(dp, []).append(paths[key])
    for world, configs in by_world.items():
        launch_many(configs, world)
    return paths


@pytest.mark.parametrize("dp,acc,zero,extra", CASES)
def test_dp_matches_single_process(runs, dp, acc, zero, extra):
    assert_same_run(runs[reference_name(dp, acc, extra)], runs[case_name(dp, acc, zero, extra)])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "dp.json"
    launch_script(os.path.join(ROOT, "tests", "workers", "dp_worker.py"), 4, [out], 300)
    return json.loads(out.read_text())


def test_first_reduction_starts_before_backward_ends(measured):
    for key in ("zero0", "zero1", "zero2"):
        m = measured[key]
        assert m["num_buckets"] >= 3
        assert len(m["launch_log"]) == m["num_buckets"]      # every bucket reduced once
        first_bucket, grads_ready = m["launch_log"][0]
        # one parameter gets no gradient: a backward makes num_params - 1 of them, so a
        # launch before the last one is ready is a launch mid-backward
        assert grads_ready < m["num_params"] - 1, m["launch_log"]
    # distributed.overlap_grad_reduce=false: every reduction waits until backward is done
    m = measured["no_overlap"]
    assert len(m["launch_log"]) == m["num_buckets"]
    assert all(ready == m["num_params"] - 1 for _, ready in m["launch_log"]), m["launch_log"]


def test_a_dropped_run_frees_its_memory(measured):
    """GradBuckets' hooks sit on the parameters: were they bound methods, each run would leave
    its model, gradients and optimizer state allocated for the life of the process (bench/
    largest_batch.py found 0.5+ GB left per configuration on the GPU)."""
    for key, m in measured.items():
        assert m["alive_after_drop"] == 0, key


def test_zero_shards_optimizer_state_and_gradients(measured):
    full = measured["zero0"]
    # 4 DP ranks: each holds ~1/4 of AdamW's moments (padding makes it a little more).
    for key in ("zero1", "zero2"):
        ratio = measured[key]["state_bytes"] / full["state_bytes"]
        assert 0.24 < ratio < 0.27, (key, ratio)
    assert measured["zero1"]["grad_bytes"] == pytest.approx(full["grad_bytes"], rel=0.02)
    ratio = measured["zero2"]["grad_bytes"] / full["grad_bytes"]
    assert 0.24 < ratio < 0.27, ratio
    assert 0.45 < measured["zero1_offload_half"]["offloaded_frac"] < 0.75


def test_zero_reduces_only_the_owned_shards(measured):
    """ZeRO-1 and 2 reduce-scatter (each rank receives the sum of its own shard, the only one
    its optimizer reads: half an all-reduce's bytes); without ZeRO every rank needs the whole
    sum: an all-reduce. Their parity with one process is test_dp_matches_single_process."""
    assert measured["zero0"]["reductions"] == ["all_reduce"]
    assert measured["zero1"]["reductions"] == ["reduce_scatter"]
    assert measured["zero2"]["reductions"] == ["reduce_scatter"]


def test_fp16_loss_scaler_skips_and_recovers():
    s = DynamicLossScaler(True, initial_scale=1024.0, window=3)
    s.update(overflow=True)
    assert (s.scale, s.skipped_steps) == (512.0, 1)
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 1024.0
    off = DynamicLossScaler(False, 1024.0, 3)
    off.update(overflow=True)
    assert off.scale == 1.0


def test_fp16_training_skips_overflowing_steps_and_trains(tmp_path):
    """fp16 on CPU with an absurd initial scale: the first steps overflow, are skipped and
    logged, the scale halves each time, and training then proceeds with finite losses."""
    path = write_config(tmp_path, "fp16", TINY + ["--set", "training.dtype=float16",
                                                  "--set", "training.initial_loss_scale=4294967296",
                                                  "--total_train_steps", "60",
                                                  "--set", "checkpoint.save_frequency=0"])
    launch(path, 1)
    records = read_metrics(path)
    skipped = [r["step"] for r in records if r["skipped"]]
    # fp16 gradients overflow until the scale is below ~1e5: about 16 halvings from 2^32 (the
    # largest initial scale the config takes), fewer than training.max_skipped_steps (25)
    # (then, rarely, one more overflow as the gradients grow: the scale halves again)
    first = next(i for i, s in enumerate(skipped + [0]) if s != i + 1)   # the opening run
    assert 10 <= first <= 24 and len(skipped) - first <= 3, skipped
    for s in skipped[1:]:
        assert records[s - 1]["loss_scale"] == records[s - 2]["loss_scale"] / 2
    good = [r for r in records if not r["skipped"]]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in good)
    assert sum(r["loss"] for r in good[-10:]) / 10 < records[0]["loss"] - 0.5   # it learns


def test_a_non_finite_gradient_skips_the_update_in_any_dtype(tmp_path):
    """fp32 (no loss scaler): from the second step on the gradient norm is not finite (as a
    diverged model's: tests/workers/diverging_run.py, which records the weights after each
    step). Those steps must be recorded as skipped and leave the weights as they were; none
    of them is saved, and the run, ending while it skips, ends with status 2."""
    path = write_config(tmp_path, "nan", TINY + ["--set", "training.warmup_steps=0",
                                                 "--set", "checkpoint.save_frequency=1"])
    worker = os.path.join(ROOT, "tests", "workers", "diverging_run.py")
    done = subprocess.run([sys.executable, worker, path, "2"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2 and "steps 2-5 (4 in a row) were skipped" in done.stderr, (
        done.stderr[-2000:])
    records = read_metrics(path)
    assert [r["skipped"] for r in records] == [False] + [True] * 4, records
    assert all(r["grad_norm"] is None for r in records[1:])    # not finite: written as null
    with open(os.path.join(tmp_path, "nan", "weight_sums.jsonl")) as f:
        sums = [json.loads(line) for line in f]
    assert len(sums) == 5 and all(s == sums[0] for s in sums[1:]), sums
    assert sorted(os.listdir(os.path.join(tmp_path, "nan", "checkpoints"))) == [
        "latest", "step_000001"]


def test_precision_regimes_hold_the_stated_optimizer_state(measured):
    """Bytes of optimizer state per parameter: fp32 params, two fp32 moments (8); bf16 with
    fp32 master weights, master + two fp32 moments (12); bf16 without (picotron's regime),
    two bf16 moments (4)."""
    assert measured["zero0"]["bytes_per_param"] == pytest.approx(8, rel=1e-3)
    assert measured["bf16_master"]["bytes_per_param"] == pytest.approx(12, rel=1e-3)
    assert measured["bf16_no_master"]["bytes_per_param"] == pytest.approx(4, rel=1e-3)


def test_offloaded_masters_are_copies_even_on_a_cpu(tmp_path):
    """On a CPU run with fp32 weights, `.float().cpu()` of a shard is the shard itself: the
    offloaded AdamW would then write the parameters directly, and the dp4 offload case above
    could not see a wrong copy-back from the CPU masters to the parameters."""
    import torch.distributed as dist

    import create_config
    import train
    from picotron.config import load_config
    from picotron.process_group_manager import ProcessGroupManager
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "o", "--use_cpu",
                               *TINY, *OFFLOAD])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _, _, _, opt = train.build_training(load_config(path), ProcessGroupManager(dp=1),
                                        torch.device("cpu"))
    pairs = [(m, s) for m, s, off in zip(opt.masters, opt.param_shards, opt.offloaded) if off]
    assert pairs and all(m.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
                         for m, s in pairs)
