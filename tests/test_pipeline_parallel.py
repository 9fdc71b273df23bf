"""Pipeline parallelism: schedules checked as data, then whole runs against one process.

Parity: each pipeline run (pp = 2 and 4, every engine) must compute the same training run as
one process with the same config and global batch: the loss at each of 5 steps and the grad
norm to 1e-5 relative, the final weights to 1e-5 (fp32; the only differences are the order of
floating-point sums: the tied gradient is summed across stages after accumulation instead of
inside it, the grad norm is summed stage by stage).
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from launch import (ROOT, final_weights, free_port, launch_many, launch_script, read_metrics,
                    write_config)
from picotron.config import ConfigError, config_from_dict
from picotron.pipeline_parallel.schedules import (idle_slots, peak_alive, rank_steps,
                                                  schedule_orders, timeline)
from picotron.pipeline_parallel.stage import describe_split, stage_layers

# ---- schedules as data (no processes) -------------------------------------------------------


@pytest.mark.parametrize("engine", ["afab", "1f1b", "interleaved"])
def test_every_schedule_runs_each_micro_batch_once_and_pairs_its_messages(engine):
    for pp, m, v in [(2, 2, 2), (2, 4, 1), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (2, 6, 4)]:
        v = v if engine == "interleaved" else 1
        orders = schedule_orders(engine, pp, m, v)
        for order in orders:          # every (chunk, micro) forward once, its backward after
            fwd = [(a.chunk, a.micro) for a in order if a.kind == "F"]
            bwd = [(a.chunk, a.micro) for a in order if a.kind == "B"]
            assert sorted(fwd) == sorted(bwd) == [(c, i) for c in range(v) for i in range(m)]
            for k, a in enumerate(order):
                if a.kind == "B":
                    assert ("F", a.chunk, a.micro) in [(b.kind, b.chunk, b.micro)
                                                       for b in order[:k]]
        ticks = timeline(orders, v)   # raises on deadlock
        steps = [rank_steps(ticks, r, v) for r in range(pp)]
        sends = sorted((s.tick, m) for r in range(pp) for s in steps[r] for m in s.sends)
        recvs = sorted((s.tick, m) for r in range(pp) for s in steps[r] for m in s.recvs)
        assert sends == recvs         # every send meets its receive in the same exchange
        assert len(sends) == 2 * m * (pp * v - 1)


def test_1f1b_keeps_at_most_pp_micro_batches_alive_and_afab_keeps_all():
    pp, m = 4, 8
    assert [peak_alive(o) for o in schedule_orders("1f1b", pp, m)] == [4, 3, 2, 1]
    assert [peak_alive(o) for o in schedule_orders("afab", pp, m)] == [m] * pp


def test_interleaved_has_a_smaller_bubble_than_1f1b():
    """pp = 4, 8 micro-batches. A tick is one chunk's forward or backward; an interleaved
    chunk (v = 2) is half a stage, so its idle ticks count half. 1F1B idles 2*(pp-1) stage
    slots per rank; interleaving divides that by v (Narayanan et al. 2021, section 2.2)."""
    pp, m, v = 4, 8, 2
    plain = idle_slots(timeline(schedule_orders("1f1b", pp, m)))
    inter = idle_slots(timeline(schedule_orders("interleaved", pp, m, v), v)) / v
    assert plain == pp * 2 * (pp - 1) == 24
    assert inter == plain / v < plain
    assert idle_slots(timeline(schedule_orders("afab", pp, m))) == plain   # same bubble


def test_stage_split_is_balanced_and_states_uneven_counts():
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(6, 4) == [[0, 1], [2, 3], [4], [5]]
    cfg = config_from_dict({"distributed": {"pp_size": 2, "pp_engine": "interleaved"},
                            "model": {"num_hidden_layers": 8},
                            "training": {"gradient_accumulation_steps": 2}})
    assert describe_split(cfg) == ("pipeline interleaved: rank 0: 0-1 + 4-5 | rank 1: 2-3 + 6-7"
                                   "; bubble 1/(4+1) = 20%")


@pytest.mark.parametrize("raw, message", [
    ({"distributed": {"pp_size": 4}, "model": {"num_hidden_layers": 3},
      "training": {"gradient_accumulation_steps": 4}}, "num_hidden_layers=3 < pp_size=4"),
    ({"distributed": {"pp_size": 4, "pp_engine": "interleaved"}, "model": {"num_hidden_layers": 8},
      "training": {"gradient_accumulation_steps": 2}}, "a multiple of pp_size=4 (at least 4"),
    ({"distributed": {"pp_size": 2, "pp_engine": "interleaved"}, "model": {"num_hidden_layers": 8},
      "training": {"gradient_accumulation_steps": 3}}, "a multiple of pp_size=2"),
    ({"distributed": {"pp_size": 2, "pp_engine": "interleaved", "pp_virtual_stages": 3},
      "model": {"num_hidden_layers": 8}, "training": {"gradient_accumulation_steps": 2}},
     "into pp_size*pp_virtual_stages = 2*3"),
])
def test_clear_errors(raw, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw)
    assert message in str(error.value)


# ---- whole runs against one process ---------------------------------------------------------

TINY = ["--mbs", "2", "--seq_len", "32", "--total_train_steps", "5", "--dataset_name",
        "synthetic", "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--set", "checkpoint.save_frequency=5"]
# Every engine sees a tied and an untied model, a Llama and a PaLM-style one.
MODELS = {
    "llama_tied": ["--num_hidden_layers", "8", "--set", "model.tie_word_embeddings=true"],
    "palm_untied": ["--num_hidden_layers", "6", "--set", "model.parallel_residual=true",
                    "--set", "model.norm_type=layernorm"],           # 6 layers: uneven at pp 4
    "palm_tied": ["--num_hidden_layers", "8", "--set", "model.parallel_residual=true",
                  "--set", "model.norm_type=layernorm", "--set", "model.tie_word_embeddings=true"],
    "llama_untied": ["--num_hidden_layers", "8"],
}
ACCUM = 4      # micro-batches per step in the references: >= pp for every case below
CASES = [      # (model, pp, engine, dp, tp, cp); dp 2 halves the micro-batches: same batch
    ("llama_tied", 2, "afab", 1, 1, 1), ("palm_untied", 4, "afab", 1, 1, 1),
    ("palm_tied", 2, "1f1b", 1, 1, 1), ("llama_untied", 4, "1f1b", 1, 1, 1),
    ("llama_untied", 2, "interleaved", 2, 1, 1), ("palm_tied", 4, "interleaved", 1, 1, 1),
    ("llama_tied", 2, "interleaved", 1, 2, 1),     # with tensor + sequence parallelism
    ("palm_tied", 2, "1f1b", 1, 1, 2),             # with context parallelism (ring)
]


def case_name(model, pp, engine, dp, tp, cp):
    return f"{model}-pp{pp}-{engine}-dp{dp}-tp{tp}-cp{cp}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case and its single-process reference (the same batch by accumulation), one
    launch per world size (tests/launch.py launch_many). Returns {name: config path}."""
    root, paths, by_world = tmp_path_factory.mktemp("pp"), {}, {}
    for model in MODELS:
        paths[model] = write_config(root, model, TINY + MODELS[model] +
                                    ["--grad_acc_steps", str(ACCUM)])
        by_world.setdefault(1, []).append(paths[model])
    for model, pp, engine, dp, tp, cp in CASES:
        key = case_name(model, pp, engine, dp, tp, cp)
        paths[key] = write_config(root, key, TINY + MODELS[model] + [
            "--pp", str(pp), "--pp_engine", engine, "--dp", str(dp), "--tp", str(tp),
            "--cp", str(cp), "--set", f"distributed.sequence_parallel={json.dumps(tp > 1)}",
            "--grad_acc_steps", str(ACCUM // dp)])
        by_world.setdefault(pp * dp * tp * cp, []).append(paths[key])
    for world, configs in by_world.items():
        launch_many(configs, world)
    return paths


@pytest.mark.parametrize("model, pp, engine, dp, tp, cp", CASES)
def test_pipeline_matches_one_process(runs, model, pp, engine, dp, tp, cp):
    cfg, ref = runs[case_name(model, pp, engine, dp, tp, cp)], runs[model]
    ours, theirs = read_metrics(cfg), read_metrics(ref)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4, 5]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]
    mine, single = final_weights(cfg), final_weights(ref)
    assert sorted(mine) == sorted(single)       # tied weight saved once, as one process does
    for name in single:
        torch.testing.assert_close(mine[name], single[name], rtol=1e-5, atol=1e-5, msg=name)


# ---- the engine itself: instrumentation (forked ranks), failures (under torchrun) ----------

def write_script(tmp_path, body: str) -> str:
    """A small script that imports picotron, written to tmp_path."""
    script = tmp_path / "probe.py"
    script.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + body)
    return str(script)


def run_script(tmp_path, body: str, nproc: int, timeout: int = 120):
    """torchrun the script: how torchrun ends a failed run is what the caller tests."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), write_script(tmp_path, body)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


PEAK_PROBE = """
import json, torch, torch.distributed as dist
import train
from picotron.config import config_from_dict
from picotron.data.windows import build_data, micro_batch
from picotron.loss import causal_lm_loss
from picotron.pipeline_parallel.engine import run_steps, steps_for
from picotron.pipeline_parallel.stage import rank_chunks
from picotron.process_group_manager import ProcessGroupManager
dist.init_process_group("gloo")
peaks = {}
for engine in ("afab", "1f1b"):
    config = config_from_dict({"distributed": {"pp_size": 4, "pp_engine": engine, "use_cpu": True},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4},
        "training": {"gradient_accumulation_steps": 8, "micro_batch_size": 1, "seq_length": 16,
                     "dtype": "float32"}, "dataset": {"name": "synthetic"}}, 4)
    pgm = ProcessGroupManager(pp=4)
    model = train.build_model(config, pgm, torch.device("cpu"))
    data = build_data(config)
    batch = lambda micro: micro_batch(data, 0, micro, config, pgm) + (None,)
    steps = steps_for(engine, 4, 8, 1, pgm.pp_rank)
    _, peaks[engine] = run_steps(model, steps, rank_chunks(config, pgm.pp_rank), batch,
                                 causal_lm_loss, config, pgm)
if pgm.pp_is_first_stage:
    print("PEAKS", json.dumps(peaks))
dist.destroy_process_group()
"""


def test_engine_activations_alive_on_first_stage(tmp_path):
    """Counted by the engine itself: micro-batches forwarded and not yet backwarded."""
    proc = launch_script(write_script(tmp_path, PEAK_PROBE), 4, timeout=120)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PEAKS"))
    assert json.loads(line.split(" ", 1)[1]) == {"afab": 8, "1f1b": 4}


FAULT = """
import os, time
import train
from picotron.pipeline_parallel import engine
real_forward = engine.forward_step
def forward_step(*args, **kwargs):
    if os.environ["RANK"] == "1":
        {fault}
    return real_forward(*args, **kwargs)
engine.forward_step = forward_step
train.main(["--config", {config!r}])
"""


@pytest.mark.parametrize("fault, expected", [
    ("raise RuntimeError('deliberate failure on stage 1')", "deliberate failure on stage 1"),
    ("time.sleep(600)", "Timed out"),        # a stuck (not dead) stage: the timeout fires
])
def test_a_failing_stage_brings_every_rank_down(tmp_path, fault, expected):
    cfg = write_config(tmp_path, "dead", TINY + ["--pp", "2", "--grad_acc_steps", "2",
                                                 "--num_hidden_layers", "2",
                                                 "--set", "distributed.timeout_s=5"])
    start = time.time()
    proc = run_script(tmp_path, FAULT.format(fault=fault, config=cfg), nproc=2, timeout=100)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert time.time() - start < 90
