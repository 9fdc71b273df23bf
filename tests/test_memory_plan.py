"""The memory estimate (picotron/plan/memory_plan.py): against a measured CPU training step, against
the tensors autograd saves, in how it scales with the layout, and the refusal it makes."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from launch import ROOT
from picotron.attention import eager_attention, sdpa_attention
from picotron.config import config_from_dict
from picotron.plan.memory_activations import in_flight, layer_bytes, rank_layer_spans
from picotron.plan.memory_plan import (MARGIN, GiB, describe, estimate, fp8_auto_note,
                                      memory_errors, memory_warning, rank_params)
from picotron.model import Decoder, materialize
from picotron.pipeline_parallel.schedules import peak_alive, schedule_orders
from picotron.pipeline_parallel.stage import rank_chunks

# tens of MB of activations and logits: above the noise of a process's resident set
MEASURED = {"distributed": {"use_cpu": True},
            "model": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704,
                      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
            "training": {"micro_batch_size": 4, "seq_length": 512, "dtype": "float32"},
            "dataset": {"name": "synthetic"}}
# The estimate against the resident peak of a real step: within 10% (it measured 1-5% on this
# machine, the estimate a little below: allocator slack and library scratch it does not count)
TOLERANCE = 0.10


def config(changes=None, base=MEASURED, world_size=None):
    raw = json.loads(json.dumps(base))
    for name, value in (changes or {}).items():
        section, key = name.split(".")
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw, world_size=world_size)


def row(e, name):
    return sum(r.bytes for r in e.rows if r.name == name)


MEASURED_CHANGES = [
    {},                                                 # fp32, every activation kept
    {"training.dtype": "bfloat16", "training.activation_checkpointing": "selective",
     "training.fused_loss": "chunked", "model.parallel_residual": True}]


def test_estimate_matches_the_measured_peak_of_a_cpu_step():
    """Two training steps per config in a child process; its resident-set high-water mark
    grows by what the steps needed (tests/workers/memory_peak.py says why that is honest)."""
    raws = [json.dumps(config(changes).to_dict()) for changes in MEASURED_CHANGES]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers",
                                                        "memory_peak.py"), *raws],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = [int(line.split()[1]) for line in proc.stdout.splitlines()
             if line.startswith("PEAK")]
    assert len(peaks) == len(MEASURED_CHANGES), proc.stdout
    for changes, measured in zip(MEASURED_CHANGES, peaks):
        estimated = estimate(config(changes)).device_bytes
        assert measured > 100 * 2 ** 20, measured        # large enough to measure
        assert abs(estimated - measured) <= TOLERANCE * measured, (changes, estimated, measured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("block", [{}, {"model.parallel_residual": True,
                                        "model.norm_type": "layernorm"}])
def test_layer_formula_is_what_autograd_saves(dtype, attention, block):
    """Bytes saved for backward per layer and token, counted with saved-tensor hooks (one
    storage counted once, parameters excluded) as the difference of 3 layers and 1, against
    memory_activations.layer_bytes on the torch path."""
    B, T = 2, 64
    changes = {**block, "model.attn_implementation": attention, "model.kernels": "torch",
               "training.dtype": str(dtype).removeprefix("torch."), "training.seq_length": T}
    counted = []
    for layers in (1, 3):
        cfg = config({**changes, "model.num_hidden_layers": layers, "model.hidden_size": 128,
                      "model.intermediate_size": 352, "model.vocab_size": 256})
        attention_fn = eager_attention if attention == "eager" else sdpa_attention
        model = materialize(Decoder(cfg.model, attention_fn), 0, torch.device("cpu"), dtype)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 256, (B, T)))
        counted.append(sum(saved.values()))
    per_layer = (counted[1] - counted[0]) / 2
    formula = B * T * layer_bytes(cfg, "none") + (T * T if attention == "eager" else 0)
    # LayerNorm in bf16 also keeps an fp32 copy of its gain per layer (4C bytes): not counted
    assert abs(per_layer - formula) <= 4 * 128 * 2, (per_layer, formula)


def test_pipeline_arithmetic_matches_the_schedules_and_the_split():
    """in_flight against schedules.peak_alive, rank_layer_spans against stage.rank_chunks
    (uneven splits included)."""
    for engine, pp, m, v, layers in [("afab", 4, 6, 1, 10), ("1f1b", 4, 6, 1, 10),
                                     ("1f1b", 4, 2, 1, 7), ("interleaved", 2, 4, 2, 12),
                                     ("interleaved", 4, 8, 2, 16), ("interleaved", 2, 2, 3, 12),
                                     ("interleaved", 4, 8, 1, 16), ("interleaved", 3, 6, 1, 9)]:
        cfg = config({"distributed.pp_size": pp, "distributed.pp_engine": engine,
                      "distributed.pp_virtual_stages": v, "model.num_hidden_layers": layers,
                      "training.gradient_accumulation_steps": m})
        orders = schedule_orders(engine, pp, m, v)
        for r in range(pp):
            assert in_flight(cfg, r) == peak_alive(orders[r]), (engine, pp, m, v, r)
            spans = [[str(i) for i in range(a, a + n)] for a, n in rank_layer_spans(cfg, r)]
            assert spans == rank_chunks(cfg, r)


def test_the_estimate_scales_with_the_layout():
    base = estimate(config())
    layers, C = 4, 256
    # tp=2 halves every matrix; the norms' gains (2 per layer and the final one) are replicated
    tp2 = estimate(config({"distributed.tp_size": 2}))
    assert 2 * row(tp2, "weights") - row(base, "weights") == 4 * (2 * layers + 1) * C
    # ZeRO-1 over dp=4 divides the AdamW state by 4, and leaves the weights whole
    dp4 = estimate(config({"distributed.dp_size": 4}))
    zero1 = estimate(config({"distributed.dp_size": 4, "distributed.zero_stage": 1}))
    assert row(zero1, "AdamW state") * 4 == row(dp4, "AdamW state")
    assert row(zero1, "weights") == row(dp4, "weights")
    # full recomputation keeps one (B, T, C) input per layer
    full = estimate(config({"training.activation_checkpointing": "full"}))
    N = 4 * 512
    assert row(full, "activations") == layers * N * C * 4
    assert row(full, "activations") < row(base, "activations") / 5
    assert full.device_bytes < base.device_bytes
    # pp=2: each stage holds half the layers, the first micro-batches in flight under 1f1b
    pp2 = config({"distributed.pp_size": 2, "training.gradient_accumulation_steps": 4})
    assert sum(n for _, n in rank_layer_spans(pp2, 0)) == layers // 2
    assert rank_params(pp2, 0).total + rank_params(pp2, 1).total == rank_params(config(), 0).total
    # offloading moves the AdamW state to the host
    off = estimate(config({"distributed.offload_optim_frac": 1.0}))
    assert row(off, "AdamW state") == 0 and row(off, "CPU-offloaded AdamW state") > 0


def test_a_plan_made_without_an_fp8_gpu_says_what_auto_adds_on_one(monkeypatch):
    """On a machine without FP8 tensor cores training.fp8=auto counts as none; the command
    line then says what a GPU that has them adds: the FP8 weight copies, 2 B a projection
    parameter. Nothing to say for a model auto keeps in bf16, or a CPU run."""
    from picotron.config import features as config_features
    monkeypatch.setattr(config_features, "fp8_tensor_cores", lambda: False)
    wide = {"model": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
                      "num_attention_heads": 16, "num_key_value_heads": 4},
            "training": {"dtype": "bfloat16"}}
    here = config_from_dict(wide)
    assert here.training.fp8 == "none"
    note = fp8_auto_note(here, estimate(here))
    projections = 2 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 5632)
    assert f"picks 'tensorwise_delayed' for this model: {projections * 2 / GiB:.3f} GiB more" \
        in note
    assert fp8_auto_note(config(), estimate(config())) is None              # hidden 256
    cpu = config_from_dict({**wide, "distributed": {"use_cpu": True}})
    assert fp8_auto_note(cpu, estimate(cpu)) is None


def test_under_cuda_graphs_the_step_is_counted_beside_the_activations():
    """A graphs run holds its layers' activations in the graphs' private pool, which the
    eager work at the step's end cannot reuse (measured on a GPU by bench/memory_plan_check.py:
    max_memory_reserved): the same rows, totalled held + forward + step instead of
    held + max(forward, step)."""
    gpu = {"model": MEASURED["model"], "dataset": {"name": "synthetic"},
           "training": {**MEASURED["training"], "dtype": "bfloat16"}}
    eager = estimate(config({"training.cuda_graphs": False}, base=gpu))
    graphs = estimate(config({"training.cuda_graphs": True}, base=gpu))
    assert [tuple(r) for r in graphs.rows] == [tuple(r) for r in eager.rows]
    held, forward, step = (sum(r.bytes for r in eager.rows if r.when == w)
                           for w in ("held", "forward", "step"))
    assert step > 0 and forward > 0
    assert eager.device_bytes == held + max(forward, step)
    assert graphs.device_bytes == held + forward + step
    assert "held + forward + step: CUDA graphs" in describe(graphs)


def test_refusal_names_the_biggest_parts_and_what_would_fit():
    cfg = config({"training.micro_batch_size": 16})
    need = estimate(cfg).device_bytes
    full = estimate(config({"training.micro_batch_size": 16,
                            "training.activation_checkpointing": "full"})).device_bytes
    assert memory_errors(cfg, device_memory=2 * need, host_memory=2 * need) == ""
    assert memory_errors(cfg, device_memory=need, host_memory=2 * need) == ""   # just fits
    assert full * (1 + MARGIN) < need
    free = need - 1          # too little by a byte; full recomputation fits with the margin
    message = memory_errors(cfg, device_memory=free, host_memory=2 * need)
    assert f"{need / GiB:.1f} GiB" in message and "per GPU but the GPU has" in message
    assert "usable (its total less 3.2 GiB outside PyTorch)" in message
    assert "biggest parts: activations" in message
    assert "training.activation_checkpointing=full" in message
    assert "training.micro_batch_size=" in message and "gradient_accumulation_steps=" in message
    assert "\n" not in message
    # CPU runs: every rank of the host shares its memory
    assert memory_errors(cfg, None, host_memory=1.5 * need, ranks_per_host=1) == ""
    assert "on this host (2 ranks)" in memory_errors(cfg, None, 1.5 * need, ranks_per_host=2)


def test_one_gpu_is_told_the_smallest_offload_that_fits():
    """Where nothing fits on this many GPUs (the state dominates: one short sequence, full
    recomputation), the refusal names the least AdamW state to step on the host, in tenths."""
    gpu = {"model": MEASURED["model"], "dataset": {"name": "synthetic"},
           "training": {"micro_batch_size": 1, "seq_length": 64, "dtype": "float32",
                        "activation_checkpointing": "full"}}
    offloaded = {f: estimate(config({"distributed.offload_optim_frac": f}, base=gpu))
                 for f in (0.0, 0.4, 0.5)}
    assert offloaded[0.5].device_bytes < offloaded[0.4].device_bytes < offloaded[0.0].device_bytes
    # half the state offloaded leaves the margin; 0.4 would fit, but not with the margin
    free = offloaded[0.5].device_bytes * (1 + MARGIN)
    assert offloaded[0.4].device_bytes < free < offloaded[0.4].device_bytes * (1 + MARGIN)
    host = 2 * offloaded[0.5].host_bytes
    message = memory_errors(config(base=gpu), device_memory=free, host_memory=host)
    advice = message.split("to spare: ")[1].split(" (a larger")[0].split("; ")
    assert advice[-1] == "distributed.offload_optim_frac=0.5", message
    assert all("tp_size" in a or "pp_size" in a for a in advice[:-1]), message
    # a host too small for half the state: no offload is named
    message = memory_errors(config(base=gpu), free, offloaded[0.5].host_bytes * 0.9)
    assert "offload_optim_frac" not in message, message


def test_train_refuses_absurd_sizes_quickly_without_allocating(tmp_path):
    """Sizes the config's ranges accept but no machine holds: train.py stops with one line
    before building anything. The three run in one child, one after the other (torch's import
    paid once); its peak resident set stays that of the import."""
    wrapper = ("import resource, runpy, sys\n"
               "for path in sys.argv[1:]:\n"
               "    sys.argv = ['train.py', '--config', path]\n"
               "    try:\n"
               "        runpy.run_path('train.py', run_name='__main__')\n"
               "    except SystemExit as e:\n"
               "        print('EXIT', e.code)\n"
               "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    cases = [{"training.micro_batch_size": 65536, "training.seq_length": 8192,
              "model.max_position_embeddings": 8192},
             {"model.num_hidden_layers": 4096, "model.hidden_size": 4096,
              "model.intermediate_size": 11008, "model.num_attention_heads": 32,
              "model.num_key_value_heads": 32},
             {"training.seq_length": 2 ** 24, "model.max_position_embeddings": 2 ** 24,
              "training.micro_batch_size": 64}]
    paths = []
    for i, changes in enumerate(cases):
        cfg = config(changes, base={"distributed": {"use_cpu": True},
                                    "dataset": {"name": "synthetic"}})
        assert estimate(cfg).device_bytes > 2 ** 43          # > 8 TiB: no host has it
        paths.append(tmp_path / f"absurd{i}.json")
        paths[-1].write_text(json.dumps(cfg.to_dict()))
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", wrapper, *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert time.time() - start < 120            # torch's import and three refusals
    assert proc.stdout.count("EXIT 2") == 3, (proc.stdout, proc.stderr[-2000:])
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 3 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(e.startswith("error: this config needs an estimated") for e in errors), errors
    assert int(proc.stdout.split("RSS")[1]) < 2 * 2 ** 20      # KiB: under 2 GiB


def test_the_command_line_names_a_bad_config_without_a_traceback(tmp_path, capsys):
    from picotron.plan.memory_plan import main
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    for path, words in ((str(tmp_path / "missing.json"), "missing.json' does not exist"),
                        (str(bad), "must be a JSON object, got list"),
                        (str(tmp_path), f"Is a directory; give {bad}")):
        with pytest.raises(SystemExit) as stopped:
            main([path])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith("error: ") and words in err, err


def test_the_command_line_says_whether_the_config_fits_this_machine(tmp_path, capsys,
                                                                    monkeypatch):
    """After the table, the verdict train.py's check would give here: fits (exit 0), or its
    refusal with the changes that would fit (exit 1)."""
    from picotron.plan import memory_plan
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config().to_dict()))
    memory_plan.main([str(path)])
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("fits this machine: the estimate is within the "
                                           "host's"), out
    half = estimate(config()).device_bytes // 2
    monkeypatch.setattr(memory_plan, "host_memory_bytes", lambda: half)
    with pytest.raises(SystemExit) as stopped:
        memory_plan.main([str(path)])
    out, err = capsys.readouterr()
    assert "per device (held + max(forward, step))" in out               # the table first
    assert stopped.value.code == 1 and err.startswith("error: does not fit this machine: this "
                                                      "config needs an estimated"), err
    assert "these would fit with 10% to spare: " in err and "Traceback" not in err, err
