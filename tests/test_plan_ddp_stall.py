"""The wait the playbook-h100 profile adds on each pipeline receive where nanotron runs ZeRO-0
under torch DDP (trait ddp_recv_stall, picotron/plan/ddp_stall.py): on a receiving stage's
passes only, only for ZeRO-0 with dp > 1, a pipeline whose sends cross nodes and the
micro-batches the trait names; a search's cache keys on it. CPU only: the model is
arithmetic."""

import pytest

from picotron.plan.comm_time import Links, layout_groups
from picotron.plan.ddp_stall import ddp_recv_stall_s
from picotron.plan.hardware import load_profile
from picotron.plan.layouts import config_for
from picotron.plan.step_time import layer_pass, predict, predict_many, stage_times

# 16 GPUs, 8 a node: dp 2 x tp 2 x pp 4, the pipeline's outermost axis: its sends cross nodes
ROW = dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=8192, tied=0, seq=1024,
           gpus=16, gpus_per_node=8, dp=2, tp=2, pp=4, cp=1, zero=0, mbs=1, grad_acc=16)
STALL = 0.3


def playbook(**traits):
    profile = load_profile("playbook-h100").with_numbers(stall_s=STALL)
    return profile.with_traits(**traits)


def test_each_receiving_pass_waits_the_stall():
    config, profile = config_for(ROW), playbook()
    groups = layout_groups(config, profile, 8)
    assert groups["pp"][2] > 1                       # the sends cross nodes
    layer_f, layer_b, _, _ = layer_pass(config, profile, Links(profile), groups)
    recv = ddp_recv_stall_s(config, profile, True)
    assert recv == STALL
    f0, b0, _ = stage_times(config, profile, layer_f, layer_b)
    f1, b1, _ = stage_times(config, profile, layer_f, layer_b, recv_s=recv)
    # the first stage receives no activations, the last no gradients
    assert [a - b for a, b in zip(f1, f0)] == pytest.approx([0.0, STALL, STALL, STALL])
    assert [a - b for a, b in zip(b1, b0)] == pytest.approx([STALL, STALL, STALL, 0.0])


@pytest.mark.parametrize("pp", [2, 4])
def test_the_step_grows_by_a_receive_a_micro_batch_per_neighbour(pp):
    # a middle rank receives twice a micro-batch (pp 4: 2 x stall each), the ends of pp 2
    # once: the busiest rank's work grows by that, the pipeline's fill adds at most the
    # same for each of its pp - 1 other slots
    row = dict(ROW, pp=pp, tp=8 // pp)
    on, off = (predict(config_for(row), playbook(ddp_recv_stall=n), 8).step_s for n in (16, 0))
    per_micro = STALL * (2 if pp > 2 else 1)
    assert per_micro * 16 <= on - off <= per_micro * (16 + pp - 1) + 1e-9


@pytest.mark.parametrize("change", [dict(zero=1), dict(dp=1, tp=4), dict(grad_acc=8),
                                    dict(gpus_per_node=16), dict(pp=1, dp=4, tp=4)])
def test_no_wait_without_ddp_a_crossing_pipeline_or_the_micro_batches(change):
    # ZeRO-1 and dp 1 run without DDP; 8 micro-batches are fewer than the trait's 16; 16 GPUs
    # a node keep the pipeline's sends inside one; no pipeline, no receive
    row = dict(ROW, **change)
    gpn = row.pop("gpus_per_node")
    config = config_for(dict(row, gpus_per_node=gpn))
    on, off = (predict(config, playbook(ddp_recv_stall=n), gpn).step_s for n in (16, 0))
    assert on == off


def test_a_cached_search_keys_on_the_micro_batches_that_stall():
    # layouts that differ only in grad_acc share a cache: 8 and 16 micro-batches must not
    # share the stage times (one stalls, the other not)
    profile = playbook()
    configs = [config_for(dict(ROW, grad_acc=g)) for g in (8, 16, 8, 32)]
    cache = {}
    cached = predict_many(configs, profile, 8, cache)
    alone = [predict(c, profile, 8) for c in configs]
    assert [p.step_s for p in cached] == [p.step_s for p in alone]
    assert [p.parts for p in cached] == [p.parts for p in alone]
