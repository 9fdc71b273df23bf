"""Context parallelism: zigzag sharding, ring attention alone, balance, training parity.

Every check compares against one process computing the same thing on the whole sequence, in
fp32, never against stored numbers. Tolerances:
- attention alone: max |cp - full| / max |full| <= 1e-5 for outputs and dQ/dK/dV (the block
  merge and the recomputed backward reorder fp32 sums; observed ~1e-6);
- training: the loss of every step within 1e-5 relative of the single process (the
  numerics contract: every layout trains like one process; observed ~1e-7), final weights
  within rtol 1e-5, atol 1e-6 (observed ~2e-8; a wrong gradient scale or a misplaced token
  moves them by ~1e-5 and more: the learning rate during these warm-up steps is
  3e-5..1.5e-4 per step).
  Checked by breaking the code on purpose (cp=2): RoPE without the zigzag positions, or
  gradients averaged over dp only, each move the final weights by ~8e-4 (the loss by only
  ~1e-5: near initialisation the loss barely depends on them, so the weights are the sharp
  check). Larger init or learning rates make the loss sharper but let Adam turn fp32 noise in
  near-zero gradients into ~1e-6..1e-5 weight differences, so the defaults are kept.
"""
import json
import os

import pytest
import torch

from launch import ROOT, final_weights, launch_many, launch_script, read_metrics, write_config

from picotron.config import Config, ConfigError, config_from_dict
from picotron.context_parallel.kernels import (fused_block_backward, fused_block_forward,
                                               reference_block_backward, reference_block_forward)
from picotron.context_parallel.ring_attention import block_plan
from picotron.context_parallel.sharding import shard_sequence, zigzag_positions

REL_TOL = 1e-5


def test_zigzag_sharding_moves_positions_and_targets_with_tokens():
    T, B = 24, 2
    window = torch.arange(B * (T + 1)).view(B, T + 1) * 7 % 101     # any distinct-ish tokens
    inputs, targets = window[:, :-1], window[:, 1:]
    for cp in (1, 2, 3, 4):
        shards = [shard_sequence(inputs, targets, r, cp) for r in range(cp)]
        pos = torch.cat([p[0] for _, _, p in shards])
        assert sorted(pos.tolist()) == list(range(T))                # every token exactly once
        for r, (x, y, p) in enumerate(shards):
            assert x.shape == y.shape == p.shape == (B, T // cp)
            assert torch.equal(x, window[:, p[0]]) and torch.equal(y, window[:, p[0] + 1])
            chunk = T // (2 * cp)                                    # chunks r and 2cp-1-r
            assert p[0, 0] == r * chunk and p[0, -1] == (2 * cp - r) * chunk - 1
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size=8"):
        zigzag_positions(20, 0, 4)
    x, y, p = shard_sequence(inputs[:, :7], targets[:, :7], 0, 1)  # one rank: any length
    assert torch.equal(x, inputs[:, :7]) and torch.equal(p[0], torch.arange(7))


def layout(**sections):
    raw = Config().to_dict()
    for section, values in sections.items():
        raw[section].update(values)
    return raw


def test_config_refuses_what_context_parallelism_cannot_run():
    with pytest.raises(ConfigError, match="seq_length=36 is not divisible by 2\\*cp_size=8"):
        config_from_dict(layout(distributed={"cp_size": 4}, training={"seq_length": 36}))
    with pytest.raises(ConfigError, match="cp_mode='tree' must be one of"):
        config_from_dict(layout(distributed={"cp_size": 2, "cp_mode": "tree"}))
    # Ulysses splits heads over cp: MQA's single kv head cannot be split (ring attention can).
    mqa = {"num_attention_heads": 4, "num_key_value_heads": 1}
    with pytest.raises(ConfigError, match="num_key_value_heads=1 is not divisible by tp_size"):
        config_from_dict(layout(distributed={"cp_size": 2, "cp_mode": "ulysses"}, model=mqa))
    config_from_dict(layout(distributed={"cp_size": 2, "cp_mode": "ring"}, model=mqa))
    config_from_dict(layout(distributed={"cp_size": 2, "cp_mode": "ulysses"}))


def chunk_pairs(q_rows, k_rows, causal, chunk):
    nq, nk = len(q_rows) // chunk, len(k_rows) // chunk
    return nq * (nq + 1) // 2 if causal else nq * nk


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_schedule_is_balanced_and_covers_causal_attention_once(cp):
    """From the schedule: each rank computes 2cp+1 chunk pairs, and together the ranks compute
    every (query, key) pair with key <= query exactly once (contiguous chunks would give rank
    r about r+1 units of work instead)."""
    chunk = 2
    T = 2 * cp * chunk
    seen = torch.zeros(T, T, dtype=torch.long)
    for r in range(cp):
        mine, work = zigzag_positions(T, r, cp), 0
        for step in range(cp):
            src = (r - step) % cp
            rows, cols, causal = block_plan(r, src, T // cp)
            q_pos, k_pos = mine[rows], zigzag_positions(T, src, cp)[cols]
            visible = q_pos[:, None] >= k_pos[None, :]
            if causal:
                visible &= torch.ones_like(visible).tril()
            else:
                assert visible.all(), "a block marked unmasked would need a mask"
            seen[q_pos[:, None], k_pos[None, :]] += visible
            work += chunk_pairs(q_pos, k_pos, causal, chunk)
        assert work == 2 * cp + 1
    assert torch.equal(seen, torch.ones(T, T, dtype=torch.long).tril())


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_block_kernel_matches_reference(device):
    """The fused kernels' out and LSE (natural log, unpadded) equal the reference's, on a
    diagonal causal block and on a rectangular unmasked one, with GQA, lengths not multiples
    of 32 (the CUDA kernel pads its LSE). Their backward, given a row's final out and lse
    (here made up, as if other blocks had contributed), returns the reference's share."""
    g = torch.Generator().manual_seed(0)
    for Tq, Tk, causal in ((40, 40, True), (20, 40, False), (8, 8, True)):
        q, dout = (torch.randn(2, 4, Tq, 16, generator=g).to(device) for _ in range(2))
        k, v = (torch.randn(2, 2, Tk, 16, generator=g).to(device) for _ in range(2))
        ref_out, ref_lse = reference_block_forward(q, k, v, causal)
        out, lse = fused_block_forward(q, k, v, causal)
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
        final_out, final_lse = 0.7 * ref_out, ref_lse + 0.3
        pairs = [(out, ref_out), (lse, ref_lse)] + list(zip(
            fused_block_backward(q, k, v, dout, final_out, final_lse, causal),
            reference_block_backward(q, k, v, dout, final_out, final_lse, causal)))
        for a, b in pairs:
            assert a.shape == b.shape
            assert ((a - b).abs().max() / b.abs().max()).item() <= REL_TOL


def run_attention_worker(tmp_path, cp: int) -> list:
    launch_script(os.path.join(ROOT, "tests", "cp_attention_worker.py"), cp,
                  ["--out", str(tmp_path)], timeout=300)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(tmp_path, cp):
    """Causal GQA, MQA and MHA, reference and fused block kernels, and Ulysses: outputs and
    dQ/dK/dV of each rank's zigzag share equal eager attention on the whole sequence; the ring's
    kernels, counted as they run, compute the same number of chunk pairs on every rank."""
    results = run_attention_worker(tmp_path, cp)
    cases = [k for k in results[0] if k != "cp_rank"]
    assert {"gqa_reference", "mqa_reference", "gqa_fused", "mqa_fused", "ulysses_gqa_eager",
            "ulysses_mha_sdpa"} <= set(cases)
    for res in results:
        for case in cases:
            for name, err in res[case]["errors"].items():
                assert err <= REL_TOL, f"cp={cp} rank {res['cp_rank']} {case} {name}: {err:.2e}"
            if not case.startswith("ulysses"):
                assert res[case]["chunk_pairs"] == 2 * cp + 1, (case, res)


TINY = ["--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "2", "--seq_len", "32", "--total_train_steps", "5",
        "--dataset_name", "synthetic", "--set", "checkpoint.save_frequency=5"]
PALM = ["--model_name", "debug-palm"]      # parallel block, LayerNorm, tied embeddings, MQA


def assert_same_run(config, reference):
    ref_losses = [m["loss"] for m in read_metrics(reference)]
    losses = [m["loss"] for m in read_metrics(config)]
    assert len(losses) == len(ref_losses) == 5
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= REL_TOL * abs(b), f"{config} step {step}: loss {a} vs {b}"
    ref_w, w = final_weights(reference), final_weights(config)
    assert w.keys() == ref_w.keys()
    for name in ref_w:
        torch.testing.assert_close(w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


# (cp, dp, extra flags). Global batch 4 sequences in every run, two micro-batches per step.
# Every (cp, dp) in {2, 4} x {1, 2} runs once; each model sees both cp and both dp sizes.
RUNS = {"llama": [(2, 1, ["--mbs", "2", "--set", "model.attn_implementation=eager"]),
                  (4, 2, ["--mbs", "1"]),
                  (2, 1, ["--mbs", "2", "--set", "distributed.cp_mode=ulysses"])],
        "palm": [(4, 1, ["--mbs", "2"]),
                 (2, 2, ["--mbs", "1"])]}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """{model: (reference, [run config paths])}, every training in one launch per world size
    (tests/launch.py launch_many); the references are the same batch in one process."""
    root, out, by_world = tmp_path_factory.mktemp("cp"), {}, {}
    for model, runs in RUNS.items():
        base = TINY + ["--grad_acc_steps", "2"] + (PALM if model == "palm" else [])
        reference = write_config(root, f"{model}_reference", base + ["--mbs", "2"])
        by_world.setdefault(1, []).append(reference)
        paths = []
        for i, (cp, dp, extra) in enumerate(runs):
            paths.append(write_config(root, f"{model}_run{i}_cp{cp}_dp{dp}", base + [
                "--cp", str(cp), "--dp", str(dp)] + extra))
            by_world.setdefault(cp * dp, []).append(paths[-1])
        out[model] = (reference, paths)
    for world, configs in by_world.items():
        launch_many(configs, world)
    return out


@pytest.mark.parametrize("model", list(RUNS))
def test_training_matches_single_process(cp_runs, model):
    reference, paths = cp_runs[model]
    for config in paths:
        assert_same_run(config, reference)
