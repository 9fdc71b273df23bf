"""The terms the playbook-h100 profile adds for nanotron's runs: a micro-batch's stall that
grows with the job's nodes, the host's wait on each tensor-parallel collective on a
pipeline's rank, the pipeline split by each block's compute, ZeRO-1's all-reduce before it
shards and its loss's passes over the logits (tests/test_plan_nanotron_memory.py checks
nanotron's own count of its memory). Each is checked with the term set and unset (or against
this project's behaviour), so a term that stopped reaching the prediction fails here. CPU
only: the model is arithmetic."""

import pytest

from picotron.pipeline_parallel.stage import stage_layers
from picotron.plan.compute_time import ends_time
from picotron.plan.hardware import load_profile
from picotron.plan.layouts import config_for
from picotron.plan.stage_split import stage_split
from picotron.plan.step_time import predict
from picotron.plan.traffic import traffic_terms

ROW = dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=8192, tied=0, seq=1024,
           gpus=16, gpus_per_node=8, dp=2, tp=2, pp=2, cp=2, zero=1, mbs=2, grad_acc=4)
LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336, vocab=131072,
                tied=0, seq=4096, gpus=64, gpus_per_node=8, dp=8, tp=2, pp=4, cp=1, zero=1,
                mbs=1, grad_acc=32)


def playbook(**numbers):
    return load_profile("playbook-h100").with_numbers(**numbers)


def test_a_stall_lengthens_each_micro_batch_slot_by_its_share():
    # 2 nodes, half_nodes 2 and steepness 1: half the micro-batches stall; 4 micro-batches,
    # pp 2, 1F1B: (m + p - 1) slots of one forward and one backward each
    config = config_for(ROW)
    base = predict(config, playbook(stall_s=0.0), 8).step_s
    slow = predict(config, playbook(stall_s=0.2, stall_half_nodes=2.0, stall_steepness=1.0),
                   8).step_s
    assert slow - base == pytest.approx((4 + 2 - 1) * 2 * 0.2 * 0.5, rel=1e-6)


def test_the_stall_share_grows_with_the_jobs_nodes():
    config = config_for(ROW)
    stall = dict(stall_s=0.2, stall_half_nodes=4.0, stall_steepness=3.0)
    steps = [predict(config, playbook(**stall), g).step_s for g in (16, 8, 4, 2)]
    assert steps == sorted(steps) and steps[0] < steps[-1]      # fewer GPUs a node: more nodes


@pytest.mark.parametrize("pp, waits", [(1, False), (2, True)])
def test_the_host_waits_on_tensor_parallel_steps_only_on_a_pipelines_rank(pp, waits):
    config = config_for(dict(ROW, pp=pp, dp=4 // pp, grad_acc=4))
    quick = predict(config, playbook(intra_latency_pp_s=1e-7, launch_s=1e-6), 8).step_s
    slow = predict(config, playbook(intra_latency_pp_s=0.05, launch_s=1e-6), 8).step_s
    assert (slow > quick) == waits and slow >= quick


def test_the_host_wait_is_a_bound_not_an_addition():
    # a wait shorter than the layer's GPU work costs nothing
    config = config_for(dict(LLAMA_8B, mbs=8, grad_acc=4))
    assert predict(config, playbook(intra_latency_pp_s=1e-7), 8).step_s == pytest.approx(
        predict(config, playbook(intra_latency_pp_s=1e-6), 8).step_s, rel=1e-12)


def test_this_projects_split_is_the_trainers_own():
    config = config_for(LLAMA_8B)
    profile = load_profile("h200")
    layers = stage_layers(32, 4)
    assert stage_split(config, profile) == [(len(h), s == 0, s == 3)
                                            for s, h in enumerate(layers)]


@pytest.mark.parametrize("pp", [2, 4, 8, 16, 32])
def test_the_compute_split_balances_the_head_against_the_layers(pp):
    config = config_for(dict(LLAMA_8B, pp=pp, dp=32 // pp, grad_acc=32))
    split = stage_split(config, load_profile("playbook-h100"))
    assert sum(n for n, _, _ in split) == 32 and len(split) == pp
    assert split[0][1] and sum(e for _, e, _ in split) == 1 and sum(h for _, _, h in split) == 1
    C, I, V = 4096, 14336, 131072
    layer, head = 4 * C * C + 3 * C * I, V * C
    cost = [n * layer + head * h for n, _, h in split]
    equal = [len(held) * layer for held in stage_layers(32, pp)]
    equal[-1] += head
    assert max(cost) <= max(equal)          # the head's stage no longer the slowest
    # each rank but the last ends with the block that passes its share of the total
    running = 0
    for k, c in enumerate(cost[:-1]):
        running += c
        if c:
            assert running > (32 * layer + head) * (k + 1) / pp


def test_nanotrons_zero1_all_reduces_before_it_shards():
    config = config_for(dict(LLAMA_8B, pp=1, dp=32, grad_acc=8))
    profile = playbook()
    scatter = profile.with_traits(zero1_reduce="reduce_scatter")
    slow = predict(config, profile, 8).parts["dp"]
    quick = predict(config, scatter, 8).parts["dp"]
    assert slow > quick > 0


@pytest.mark.parametrize("gpus, dp, waits", [(8, 1, False), (16, 2, True)])
def test_the_host_waits_only_where_the_pipelines_sends_cross_nodes(gpus, dp, waits):
    # pp outermost: pp 2 x (dp x cp x tp = 4 or 8) ranks share one node only at 8 GPUs
    config = config_for(dict(ROW, gpus=gpus, dp=dp, grad_acc=4))
    quick = predict(config, playbook(intra_latency_pp_s=1e-7, launch_s=1e-6), 8).step_s
    slow = predict(config, playbook(intra_latency_pp_s=0.05, launch_s=1e-6), 8).step_s
    assert (slow > quick) == waits and slow >= quick


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_nanotrons_loss_moves_52_bytes_a_logit_of_the_ranks_shard(tp):
    # the head's forward and backward outside its GEMMs: nanotron's fp32 cross-entropy in
    # torch ops against this project's Triton loss (6 bytes a logit, 12 a row, 4 a hidden
    # value), over the rank's (n, V/tp) shard of the logits
    config = config_for(dict(LLAMA_8B, gpus=32, dp=32 // tp, tp=tp, pp=1, zero=0, grad_acc=8))
    ours, theirs = playbook().with_traits(loss_path="picotron"), playbook()
    assert theirs.traits["loss_path"] == "nanotron"
    n, V, C = 4096, 131072 // tp, 4096
    extra = (52 * n * V - (6 * n * V + 12 * n + 4 * n * C)) / ours["hbm_bytes_per_s"]
    assert sum(ends_time(config, theirs)["head"]) - sum(ends_time(config, ours)["head"]) == \
        pytest.approx(extra)
    assert ("loss", "head", "52*N*V") in traffic_terms(config, "nanotron")
    assert ("loss", "head", "52*N*V") not in traffic_terms(config)
