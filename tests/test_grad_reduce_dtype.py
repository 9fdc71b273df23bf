"""distributed.grad_reduce_dtype: the dtype of the gradients' cp_dp reduction on the wire
(picotron/data_parallel/buckets.py, zero3.py).

float32, the default, must train exactly as before: the key's default and an explicit
"float32" give the same bits, and dp2 matches one process at 1e-5 as every layout does.
bfloat16 has no exact answer, so its tolerance is measured here: bf16's own noise is the
largest difference between two one-process bf16 runs that differ only in how the same global
batch is split into micro-batches (4 micro-batches of 1 sequence vs 2 of 2), floored at
NOISE_FLOOR; every bf16-reduce run (dp2 at ZeRO-0 to 3, with and without accumulation) must
stay within twice that of the one-process run, in loss and in gradient norm at every step.
(Not in the weights: their largest difference comes from AdamW's normalised steps on
near-zero gradients, where any rounding flips a sign and moves a weight by a whole lr step.)
That alone would pass if the setting did nothing, so the runs also must differ from the same
config reduced in fp32, and the dtypes that went on the wire are recorded by spies
(tests/workers/grad_reduce_worker.py) and checked.

Three launches: one process (the references), 2 gloo ranks (dp2), 4 (dp2 x tp2 with sequence
parallelism, whose norm weights' gradients are partial sums over tp).
"""
import json
import os

import pytest
import torch

from launch import ROOT, final_weights, launch_many, launch_script, read_metrics, write_config
from picotron.config import Config, ConfigError, config_from_dict
from picotron.plan.memory_plan import estimate

STEPS = 6
TINY = ["--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "2", "--seq_len", "32", "--total_train_steps", str(STEPS),
        "--set", "training.warmup_steps=2", "--set", f"checkpoint.save_frequency={STEPS}",
        "--set", "distributed.bucket_size_mb=0.05", "--learning_rate", "1e-3"]
BF16, FP32 = (["--set", f"training.dtype={d}"] for d in ("bfloat16", "float32"))
# The floor of the measured noise (relative, loss and gradient norm): what a cast-free run can
# differ by in 6 steps of bf16. Measured here: loss 1.3e-4, gradient norm 4.6e-4.
NOISE_FLOOR = 1e-4


def wire(dtype):
    return ["--set", f"distributed.grad_reduce_dtype={dtype}"]


def dp2(zero, acc):
    """dp2 with the global batch of every run here: 4 sequences per step."""
    return ["--dp", "2", "--zero_stage", str(zero), "--mbs", str(2 // acc),
            "--grad_acc_steps", str(acc)]


ONE = {"ref-fp32": FP32 + ["--mbs", "2", "--grad_acc_steps", "2"],
       "ref-bf16": BF16 + ["--mbs", "2", "--grad_acc_steps", "2"],
       "split-bf16": BF16 + ["--mbs", "1", "--grad_acc_steps", "4"]}
TWO = {"fp32-default": FP32 + dp2(0, 1), "fp32-explicit": FP32 + dp2(0, 1) + wire("float32"),
       "fp32-params-bf16-wire": FP32 + dp2(0, 1) + wire("bfloat16")}
for zero in (0, 1, 2, 3):
    for acc in (1, 2):
        for dtype in ("bfloat16", "float32"):
            TWO[f"z{zero}-acc{acc}-{dtype}-wire"] = BF16 + dp2(zero, acc) + wire(dtype)
BF16_WIRE = [n for n in TWO if n.startswith("z") and n.endswith("bfloat16-wire")]
# dp2 x tp2 with sequence parallelism: the norm weights' gradients are partial sums over tp
# (grad_sum_group), so their buckets stay fp32 and go out through a bf16 copy
FOUR = {f"tp2-sp-z{zero}-{dtype}-wire": BF16 + dp2(zero, 1) + wire(dtype) + [
    "--tp", "2", "--set", "distributed.sequence_parallel=true"]
    for zero in (1, 3) for dtype in ("bfloat16", "float32")}
BF16_WIRE += [n for n in FOUR if n.endswith("bfloat16-wire")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grad_reduce")
    paths = {n: write_config(root, n, TINY + flags)
             for n, flags in {**ONE, **TWO, **FOUR}.items()}
    launch_many([paths[n] for n in ONE], 1)
    worker, seen = os.path.join(ROOT, "tests", "workers", "grad_reduce_worker.py"), {}
    for world, names in ((2, TWO), (4, FOUR)):
        out = root / f"seen{world}.json"
        launch_script(worker, world, [out] + [paths[n] for n in names], timeout=1200)
        seen.update(json.loads(out.read_text()))
    return paths, seen


def losses(path) -> list:
    return [r for r in read_metrics(path) if "loss" in r]


def max_rel_diff(run, ref, key) -> float:
    a, b = losses(run), losses(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))


def tolerances(paths) -> dict:
    """{loss, grad_norm: twice bf16's own noise}, measured on the two one-process runs."""
    return {key: 2 * max(NOISE_FLOOR, max_rel_diff(paths["split-bf16"], paths["ref-bf16"], key))
            for key in ("loss", "grad_norm")}


def test_float32_reduction_is_unchanged(runs):
    """The default is "float32" and is the old path: the same bits as asking for it, and the
    same run as one process (1e-5 relative, as every layout)."""
    paths, _ = runs
    default, explicit = (losses(paths[n]) for n in ("fp32-default", "fp32-explicit"))
    keys = ("step", "loss", "grad_norm")
    assert [[r[k] for k in keys] for r in default] == [[r[k] for k in keys] for r in explicit]
    w_default, w_explicit = (final_weights(paths[n]) for n in ("fp32-default", "fp32-explicit"))
    assert all(torch.equal(w_default[k], w_explicit[k]) for k in w_default)
    for key in ("loss", "grad_norm"):
        assert max_rel_diff(paths["fp32-default"], paths["ref-fp32"], key) <= 1e-5, key
    w_ref = final_weights(paths["ref-fp32"])
    for k in w_ref:
        torch.testing.assert_close(w_default[k], w_ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", BF16_WIRE)
def test_bf16_reduction_matches_one_process_within_bf16s_noise(runs, name):
    paths, _ = runs
    tol = tolerances(paths)
    for key in ("loss", "grad_norm"):
        diff = max_rel_diff(paths[name], paths["ref-bf16"], key)
        assert diff <= tol[key], f"{name}: max rel {key} diff {diff:.2e} > {tol[key]:.2e}"
    # the cast happened: the same config reduced in fp32 is another run
    fp32 = name.replace("bfloat16-wire", "float32-wire")
    assert ([r["grad_norm"] for r in losses(paths[name])]
            != [r["grad_norm"] for r in losses(paths[fp32])])


def test_fp32_parameters_reduce_in_bf16_when_asked(runs):
    """fp32 weights with a bf16 wire: rounded once on the wire, so another run than fp32's,
    within bf16's noise of it."""
    paths, _ = runs
    tol = tolerances(paths)
    for key in ("loss", "grad_norm"):
        diff = max_rel_diff(paths["fp32-params-bf16-wire"], paths["ref-fp32"], key)
        assert 0 < diff <= tol[key], (key, diff, tol[key])


def test_the_wire_carries_the_configured_dtype(runs):
    """What the spies saw: a bf16 buffer reduced in place when nothing is accumulated; an fp32
    buffer cast to a bf16 copy (and the result back in fp32) with accumulation, partial sums
    or fp32 weights; fp32 in place, as before, by default."""
    _, seen = runs
    f32, b16 = "torch.float32", "torch.bfloat16"
    expected = {"fp32-default": (f32, f32, True, f32), "fp32-explicit": (f32, f32, True, f32),
                "fp32-params-bf16-wire": (f32, b16, False, f32)}
    for zero in (0, 1, 2, 3):
        expected[f"z{zero}-acc1-bfloat16-wire"] = (b16, b16, True, b16)
        expected[f"z{zero}-acc2-bfloat16-wire"] = (f32, b16, False, f32)
        for acc in (1, 2):
            expected[f"z{zero}-acc{acc}-float32-wire"] = (f32, f32, True, f32)
    for zero in (1, 3):        # the norm weights' partial sums: fp32 buffers, cast
        expected[f"tp2-sp-z{zero}-bfloat16-wire"] = ([b16, f32], b16, [False, True], [b16, f32])
        expected[f"tp2-sp-z{zero}-float32-wire"] = (f32, f32, True, f32)
    assert set(seen) == set(expected)
    for name, values in expected.items():
        values = [v if isinstance(v, list) else [v] for v in values]
        assert seen[name] == dict(zip(("buffer", "wire", "in_place", "shard"), values)), name


def test_create_config_sets_it_and_other_dtypes_are_refused(tmp_path):
    path = write_config(tmp_path, "set", wire("bfloat16"))
    with open(path) as f:
        assert json.load(f)["distributed"]["grad_reduce_dtype"] == "bfloat16"
    assert Config().distributed.grad_reduce_dtype == "float32"
    with pytest.raises(ConfigError, match=r"grad_reduce_dtype='float16' must be one of "
                                          r"\('float32', 'bfloat16'\)"):
        config_from_dict({"distributed": {"grad_reduce_dtype": "float16"}})


def test_memory_plan_counts_the_reduction_dtype():
    """dp2, bf16 weights: one micro-batch with a bf16 wire holds bf16 gradient buffers (half of
    fp32's); with accumulation the fp32 buffers stay and their bf16 copies add 2 B each."""
    def rows(acc, dtype, zero=0):
        config = config_from_dict({"distributed": {"dp_size": 2, "use_cpu": True,
                                                   "zero_stage": zero,
                                                   "grad_reduce_dtype": dtype},
                                   "training": {"dtype": "bfloat16",
                                                "gradient_accumulation_steps": acc}})
        return {r.name: r.bytes for r in estimate(config).rows}
    fp32, bf16 = rows(1, "float32"), rows(1, "bfloat16")
    assert bf16["gradient buffers"] * 2 == fp32["gradient buffers"]
    assert "bf16 gradients on the wire" not in bf16 and "bf16 gradients on the wire" not in fp32
    acc_fp32, acc_bf16 = rows(2, "float32"), rows(2, "bfloat16")
    assert acc_bf16["gradient buffers"] == acc_fp32["gradient buffers"]
    assert acc_bf16["bf16 gradients on the wire"] * 2 == acc_bf16["gradient buffers"]
    z3_fp32, z3_bf16 = rows(1, "float32", 3), rows(1, "bfloat16", 3)
    for row in ("gradient shards", "whole gradients in flight"):
        assert z3_bf16[row] * 2 == z3_fp32[row], row
