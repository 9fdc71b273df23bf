"""Every layout on one GPU (distributed.share_gpu) trains like one process on that GPU.

    python -m pytest -q tests/test_share_gpu_gpu.py     # skipped without a CUDA GPU
    python bench/share_gpu_parity.py                    # the same runs, and the table

LAYOUTS below run 10 steps each with the GPU defaults ("auto": our Triton kernels, the fused
loss where tp = 1, selective recomputation; CUDA graphs and FP8 where auto picks them, which
for this small model is nowhere above one rank, so three rows ask for them), all ranks on
cuda:0 over gloo. Each is compared with one process on the same GPU with the same settings:
the layout's own resolved "auto" choices and speed flags, the same global batch of 8
sequences by gradient accumulation.

bf16 has no exact answer: two correct runs differ by the order of their sums. Each
quantity's noise is measured in the same call from three one-process runs with the same
settings: `ref` (2 x 4 sequences, what a layout is compared with), `resplit` (4 x 2: every sum
reordered the way a layout reorders it) and `precise` (the batch as `ref`, in the next
precision: bf16 -> fp32, FP8 -> bf16). Two checks, each quantity against max(2 x noise, floor):
- step 1, before any weight moved: the loss and grad norm, noise = resplit's step-1
  difference. Here only the gradient's rounding differs, so a missing reduction, a wrong slice
  or a stale shard shows at its full size (percents), while a correct layout stays near the
  re-split's 1e-4.
- all steps, loss, grad norm and the final weights, noise = the larger of resplit's and
  precise's differences over the run. Rounding grows over steps (Adam moves a weight by about lr
  whatever its gradient's size, so a rounding that flips a near-zero gradient's sign moves that
  weight by a whole step, and the loss follows), and one re-split run shares most of the
  reference's roundings (the same GEMMs, the same per-row arithmetic), so it under-measures
  that growth. The precision's own error does not: a correct layout and the reference are each
  about that far from the more precise run, so at most twice that from each other (the
  triangle inequality).
Floors: loss 1e-3 relative (a third of one bf16 step at the loss, 2^-8), grad norm 1e-3
relative, weights one learning rate; in fp32 (`--set training.dtype=float32`) 1e-5, 1e-5 and
lr, the CPU suites' tolerance. A missing reduction, a wrong slice or a stale shard moves the
loss by percents and the weights by many steps: far outside.
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
    # graphs beside the buckets' hooks: reductions launched from the hooks raced the replays
    ("dp2-graphs", 2, 1, 1, 1, [], ["--set", "training.cuda_graphs=true"]),
    ("dp2-graphs-fp8", 2, 1, 1, 1, [], FP8_GRAPHS),
    ("tp2-fp8", 1, 2, 1, 1, [], ["--set", "training.fp8=tensorwise"]),   # FP8 on TP shards
    ("dp2xtp2", 2, 2, 1, 1, [], []),
    ("tp2xpp2", 1, 2, 2, 1, [], []),
    ("dp2xpp2xcp2", 2, 1, 2, 2, [], []),
]
# the all-steps checks' floors by training.dtype, and the step-1 checks' (same weights)
FLOORS = {"bfloat16": {"loss": 1e-3, "grad_norm": 1e-3, "weights": LR},
          "float32": {"loss": 1e-5, "grad_norm": 1e-5, "weights": LR}}
STEP1 = {"loss@1": "loss", "grad_norm@1": "grad_norm"}      # check -> the floor it takes
CHECKS = ("loss@1", "grad_norm@1", "loss", "grad_norm", "weights")
SHARED = ["--set", "distributed.share_gpu=true"]


def write(root, name, flags) -> str:
    with contextlib.redirect_stdout(io.StringIO()):      # it prints the config's path
        return create_config.main(["--out_dir", str(root), "--exp_name", name] + BASE + flags)


def resolved(path: str, world: int):
    """The config as it runs on this machine ("auto" resolved), and its "auto" choices as
    --set flags for the one-process runs."""
    from picotron.config import load_config
    config = load_config(path, world)
    return config, [f for k, v in sorted(config.auto_resolved.items())
                    for f in ("--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}")]


def precise_flags(flags: list, training):
    """The same run one precision up (FP8 -> bf16, bf16 -> fp32); None for fp32 runs.
    `training`: the run's resolved training section."""
    if training.fp8 != "none":
        return flags + ["--set", "training.fp8=none"]
    if training.dtype != "float32":
        return flags + ["--set", "training.dtype=float32"]
    return None


def write_suite(root, layouts=LAYOUTS, on_cpu=False) -> dict:
    """Every config: {name: (path, world, reference key)}, and {reference key: ({"ref": the
    one-process run, "resplit": the re-split one, "precise": one precision up (absent in
    fp32)}, training.dtype)}; layouts of the same settings share them. `on_cpu`: gloo on
    CPU processes, no shared GPU (the criterion tried where no GPU is; the kernels are then
    the readable ones)."""
    device = ["--use_cpu"] if on_cpu else []
    runs, refs = {}, {}
    for name, dp, tp, pp, cp, layout, settings in layouts:
        world = dp * tp * pp * cp
        path = write(root, name, ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
                                  "--cp", str(cp), "--mbs", str(MBS), "--grad_acc_steps",
                                  str(GLOBAL_BATCH // (MBS * dp))]
                     + (device or SHARED) + layout + settings)
        config, chosen = resolved(path, world)
        same = device + settings + chosen
        key = " ".join(same)
        if key not in refs:
            i, split = len(refs), lambda mbs: ["--mbs", str(mbs), "--grad_acc_steps",
                                               str(GLOBAL_BATCH // mbs)]
            paths = {"ref": write(root, f"ref{i}-2x4", same + split(MBS)),
                     "resplit": write(root, f"ref{i}-4x2", same + split(2 * MBS))}
            precise = precise_flags(same, config.training)
            if precise:
                paths["precise"] = write(root, f"ref{i}-precise", precise + split(MBS))
            refs[key] = (paths, config.training.dtype)
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
    """CHECKS: the relative loss and grad-norm differences at step 1 and their largest over
    the steps, and the largest absolute difference of any final weight."""
    ref, run = ([r for r in read_metrics(p) if "loss" in r] for p in (ref_path, run_path))
    assert [r["step"] for r in run] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    out = {}
    for key in ("loss", "grad_norm"):
        rel = [abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(run, ref)]
        out[f"{key}@1"], out[key] = rel[0], max(rel)
    w_ref, w_run = final_weights(ref_path), final_weights(run_path)
    assert w_ref.keys() == w_run.keys()
    out["weights"] = max((w_run[k].float() - w_ref[k].float()).abs().max().item() for k in w_ref)
    return {k: (math.nan if not math.isfinite(v) else v) for k, v in out.items()}


def tolerances(paths: dict, floors: dict) -> dict:
    """Each check's tolerance, max(2 x noise, floor): at step 1 the re-split's difference;
    over the run the larger of the re-split's and the precision's own (module docstring)."""
    resplit = differences(paths["ref"], paths["resplit"])
    precise = differences(paths["ref"], paths["precise"]) if "precise" in paths else {}
    tols = {}
    for check in CHECKS:
        noise = resplit[check] if check in STEP1 else max(resplit[check],
                                                          precise.get(check, 0.0))
        tols[check] = max(2 * noise, floors[STEP1.get(check, check)])
    return tols


def run_suite(root, layouts=LAYOUTS, on_cpu=False) -> list:
    """Train everything (references first), compare; one row per layout: {name, world,
    diffs, tols, error, paths: the configs of the run and its one-process runs}."""
    runs, refs = write_suite(root, layouts, on_cpu)
    failed = train_all([p for paths, _ in refs.values() for p in paths.values()], 1)
    for world in sorted({w for _, w, _ in runs.values()}):
        failed.update(train_all([p for p, w, _ in runs.values() if w == world], world))
    rows = []
    for name, (path, world, key) in runs.items():
        ref_paths, dtype = refs[key]
        paths = {"run": path, **ref_paths}
        error = next((failed[p] for p in paths.values() if p in failed), None)
        row = {"name": name, "world": world, "error": error, "paths": paths}
        if not error:
            row["diffs"] = differences(paths["ref"], path)
            row["tols"] = tolerances(paths, FLOORS[dtype])
        rows.append(row)
    return rows


def passed(row) -> bool:
    return not row["error"] and all(row["diffs"][k] <= row["tols"][k] for k in CHECKS)


def table(rows) -> str:
    lines = ["| layout | ranks | loss @1 (rel) | grad norm @1 (rel) | max loss (rel) | "
             "max grad norm (rel) | max weight (abs) | result |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["error"]:
            lines.append(f"| {row['name']} | {row['world']} | - | - | - | - | - | FAILED: "
                         f"{row['error'][:160]} |")
            continue
        cells = " | ".join(f"{row['diffs'][k]:.1e} (tol {row['tols'][k]:.1e})" for k in CHECKS)
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
    for key in CHECKS:
        assert row["diffs"][key] <= row["tols"][key], (
            f"{name}: {key} differs by {row['diffs'][key]:.2e} > {row['tols'][key]:.2e}")
