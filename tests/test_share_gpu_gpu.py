"""Every layout on one GPU (distributed.share_gpu) trains like one process on that GPU.

    python -m pytest -q tests/test_share_gpu_gpu.py     # skipped without a CUDA GPU
    python bench/share_gpu_parity.py                    # the same runs, and the table

LAYOUTS below run 10 steps each with the GPU defaults ("auto": our Triton kernels, the fused
loss where tp = 1, selective recomputation; CUDA graphs and FP8 where auto picks them, which
for this small model is nowhere above one rank, so two rows ask for them), all ranks on
cuda:0 over gloo. Each is compared with one process on the same GPU with the same settings:
the layout's own resolved "auto" choices and speed flags, the same global batch of 8
sequences by gradient accumulation.

bf16 has no exact answer: two correct runs differ by the order of their sums. The tolerance
of each quantity is measured in the same call, as bench/multi_gpu.py does for loss: the
largest difference between the one-process run and another one-process run with the same
settings that only splits the batch differently (4 x 2 sequences instead of 2 x 4), which
reorders every sum the way a layout does. A layout passes within twice that, and at least:
loss 1e-3 relative (a third of one bf16 step at the loss, 2^-8), grad norm 1e-3 relative, and
weights one learning rate (Adam moves a weight by about lr a step whatever its gradient's
size, so a weight whose gradient is rounding noise can take one step either way). FP8 rows
get their own measured noise, from one-process FP8 runs. A missing reduction, a wrong slice or
a stale shard moves the loss by percents and the weights by many steps: far outside.
"""
import contextlib
import io
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import final_weights, launch_many, read_metrics  # noqa: E402

import create_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS, GLOBAL_BATCH, MBS, LR = 10, 8, 2, 1e-3
BASE = ["--model_name", "debug", "--total_train_steps", str(STEPS), "--seq_len", "64",
        "--learning_rate", str(LR), "--set", "training.warmup_steps=2",
        "--set", "distributed.timeout_s=120",
        "--set", "model.intermediate_size=352"]      # FP8 GEMMs: multiples of 16 per tp rank
FP8_GRAPHS = ["--set", "training.cuda_graphs=true", "--set", "training.fp8=tensorwise_delayed"]
# (name, dp, tp, pp, cp, layout flags, settings flags: given to the one-process run too)
LAYOUTS = [
    ("dp2", 2, 1, 1, 1, [], []),
    ("tp2", 1, 2, 1, 1, [], []),
    ("tp2-sp", 1, 2, 1, 1, ["--set", "distributed.sequence_parallel=true"], []),
    ("pp2-1f1b", 1, 1, 2, 1, ["--pp_engine", "1f1b"], []),
    ("pp2-interleaved", 1, 1, 2, 1, ["--pp_engine", "interleaved"], []),
    ("cp2-ring", 1, 1, 1, 2, ["--set", "distributed.cp_mode=ring"], []),
    ("cp2-ulysses", 1, 1, 1, 2, ["--set", "distributed.cp_mode=ulysses"], []),
    ("dp2-zero1", 2, 1, 1, 1, ["--zero_stage", "1"], []),
    ("dp2-zero2", 2, 1, 1, 1, ["--zero_stage", "2"], []),
    ("dp2-zero3", 2, 1, 1, 1, ["--zero_stage", "3"], []),
    ("dp2-offload", 2, 1, 1, 1, [], ["--set", "distributed.offload_optim_frac=0.5"]),
    ("dp2-graphs-fp8", 2, 1, 1, 1, [], FP8_GRAPHS),        # graphs beside the buckets' hooks
    ("tp2-fp8", 1, 2, 1, 1, [], ["--set", "training.fp8=tensorwise"]),   # FP8 on TP shards
    ("dp2xtp2", 2, 2, 1, 1, [], []),
    ("tp2xpp2", 1, 2, 2, 1, [], []),
    ("dp2xpp2xcp2", 2, 1, 2, 2, [], []),
]
FLOORS = {"loss": 1e-3, "grad_norm": 1e-3, "weights": LR}


def write(root, name, flags) -> str:
    with contextlib.redirect_stdout(io.StringIO()):      # it prints the config's path
        return create_config.main(["--out_dir", str(root), "--exp_name", name] + BASE + flags)


def resolved_flags(path: str, world: int) -> list:
    """The config's "auto" choices on this GPU, as --set flags for the one-process runs."""
    from picotron.config import load_config
    chosen = load_config(path, world).auto_resolved
    return [f for k, v in sorted(chosen.items())
            for f in ("--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}")]


def write_suite(root, layouts=LAYOUTS) -> dict:
    """Every config: {name: (path, world, reference key)}, and {reference key: (path of the
    one-process run, path of the re-split one)}; layouts of the same settings share them."""
    runs, refs = {}, {}
    for name, dp, tp, pp, cp, layout, settings in layouts:
        world = dp * tp * pp * cp
        path = write(root, name, ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
                                  "--cp", str(cp), "--mbs", str(MBS), "--grad_acc_steps",
                                  str(GLOBAL_BATCH // (MBS * dp)),
                                  "--set", "distributed.share_gpu=true"] + layout + settings)
        same = settings + resolved_flags(path, world)
        key = " ".join(same)
        if key not in refs:
            i = len(refs)
            refs[key] = tuple(write(root, f"ref{i}-{split}", same + [
                "--mbs", str(mbs), "--grad_acc_steps", str(GLOBAL_BATCH // mbs)])
                for split, mbs in (("2x4", MBS), ("4x2", 2 * MBS)))
        runs[name] = (path, world, key)
    return runs, refs


def train_all(paths: list, nproc: int) -> dict:
    """Train every config in one launch of `nproc` ranks; when one fails, the rest one launch
    each, so that a failure costs only its own row. {path: error} for those that failed."""
    try:
        launch_many(paths, nproc)
        return {}
    except AssertionError:
        pass
    failed = {}
    for path in paths:
        done = os.path.exists(os.path.join(os.path.dirname(path), "metrics.jsonl")) and len(
            [r for r in read_metrics(path) if "loss" in r]) == STEPS
        if not done:
            try:
                launch_many([path], nproc)
            except AssertionError as e:
                lines = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln]
                failed[path] = (lines[-1] if lines else str(e)[-300:]).strip()
    return failed


def differences(ref_path: str, run_path: str) -> dict:
    """The largest relative loss and grad-norm differences over the steps, and the largest
    absolute difference of any final weight."""
    ref, run = ([r for r in read_metrics(p) if "loss" in r] for p in (ref_path, run_path))
    assert [r["step"] for r in run] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    out = {key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(run, ref))
           for key in ("loss", "grad_norm")}
    w_ref, w_run = final_weights(ref_path), final_weights(run_path)
    assert w_ref.keys() == w_run.keys()
    out["weights"] = max((w_run[k].float() - w_ref[k].float()).abs().max().item() for k in w_ref)
    return {k: (math.nan if not math.isfinite(v) else v) for k, v in out.items()}


def run_suite(root, layouts=LAYOUTS) -> list:
    """Train everything (references first), compare; one row per layout: {name, world,
    diffs, tols, error, paths: the configs of the run and its two one-process runs}."""
    runs, refs = write_suite(root, layouts)
    failed = train_all([p for pair in refs.values() for p in pair], 1)
    for world in sorted({w for _, w, _ in runs.values()}):
        failed.update(train_all([p for p, w, _ in runs.values() if w == world], world))
    rows = []
    for name, (path, world, key) in runs.items():
        ref, resplit = refs[key]
        error = failed.get(path) or failed.get(ref) or failed.get(resplit)
        row = {"name": name, "world": world, "error": error,
               "paths": {"run": path, "ref": ref, "resplit": resplit}}
        if not error:
            noise = differences(ref, resplit)
            row["diffs"] = differences(ref, path)
            row["tols"] = {k: max(2 * noise[k], FLOORS[k]) for k in FLOORS}
        rows.append(row)
    return rows


def passed(row) -> bool:
    return not row["error"] and all(row["diffs"][k] <= row["tols"][k] for k in FLOORS)


def table(rows) -> str:
    lines = ["| layout | ranks | max loss diff (rel) | max grad-norm diff (rel) | "
             "max weight diff (abs) | result |", "|---|---|---|---|---|---|"]
    for row in rows:
        if row["error"]:
            lines.append(f"| {row['name']} | {row['world']} | - | - | - | FAILED: "
                         f"{row['error'][:160]} |")
            continue
        cells = " | ".join(f"{row['diffs'][k]:.2e} (tol {row['tols'][k]:.1e})" for k in FLOORS)
        lines.append(f"| {row['name']} | {row['world']} | {cells} | "
                     f"{'PASS' if passed(row) else 'FAIL'} |")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    rows = run_suite(tmp_path_factory.mktemp("share_gpu"))
    print("\n" + table(rows))
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("name", [lay[0] for lay in LAYOUTS])
def test_layout_on_one_gpu_trains_like_one_process(suite, name):
    row = suite[name]
    assert not row["error"], row["error"]
    for key in FLOORS:
        assert row["diffs"][key] <= row["tols"][key], (
            f"{name}: {key} differs by {row['diffs'][key]:.2e} > {row['tols'][key]:.2e}")
