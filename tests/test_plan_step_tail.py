"""The step's tail after the last backward, as both trainers run it: the embedding's gradient
is the last to come and fills a bucket of its own when larger than one, so its reduction
follows the backward; each bucket pays its ring's latency, where a trainer that shards after
reducing reduces all at once after the backward; and a tied embedding under a pipeline is
summed across the pipeline's two ends. Each is checked against the collective it stands
for. CPU only: the model is arithmetic."""

import pytest

from picotron.plan.comm_time import Links, layout_groups
from picotron.plan.hardware import load_profile
from picotron.plan.layouts import config_for
from picotron.plan.memory_state import rank_params
from picotron.plan.step_time import layer_pass
from picotron.plan.step_tail import (after_backward, embedding_rows, rank_collectives,
                                      tied_sum_s)

# a 1B-like shape whose (V, C) table (268M parameters) is far larger than a bucket
ROW = dict(layers=16, hidden=2048, heads=32, kv_heads=32, ffn=8192, vocab=131072, tied=1,
           seq=4096, gpus=64, gpus_per_node=8, dp=16, tp=2, pp=2, cp=1, zero=0, mbs=1,
           grad_acc=8)


def tail(config, profile, rank, last_backward=10.0):
    links, groups = Links(profile), layout_groups(config, profile, 8)
    collectives = rank_collectives(config, profile, links, groups, rank_params(config, rank))
    return after_backward(collectives, last_backward, 1.0)[0]


@pytest.mark.parametrize("pp, rank, rows", [(1, 0, 131072 // 2 * 2048), (2, 0, 131072 // 2 * 2048),
                                            (2, 1, 0), (4, 2, 0)])
def test_the_embedding_sits_on_the_first_rank(pp, rank, rows):
    config = config_for(dict(ROW, pp=pp, dp=32 // pp))
    assert embedding_rows(config, rank_params(config, rank)) == rows


@pytest.mark.parametrize("zero, scatters", [(0, False), (3, True)])
def test_the_embeddings_own_bucket_outlasts_a_long_backward(zero, scatters):
    # a backward far longer than the reduction hides all but the last bucket: the embedding's,
    # all-reduced, or reduce-scattered (an all-gather's time) where ZeRO-3 shards it
    config = config_for(dict(ROW, tied=0, pp=1, dp=32, zero=zero))
    profile = load_profile("playbook-h100")
    links, groups = Links(profile).data_parallel, layout_groups(config, profile, 8)
    table = embedding_rows(config, rank_params(config, 0))
    op = links.all_gather if scatters else links.all_reduce
    assert tail(config, profile, 0) == pytest.approx(op(table * 4, groups["cp_dp"]))


@pytest.mark.parametrize("tied, pp, rank, sums", [(1, 2, 0, True), (1, 2, 1, True),
                                                  (1, 4, 1, False), (1, 1, 0, False),
                                                  (0, 2, 0, False)])
def test_a_tied_embedding_is_summed_across_the_pipelines_ends(tied, pp, rank, sums):
    config = config_for(dict(ROW, tied=tied, pp=pp, dp=32 // pp))
    profile = load_profile("playbook-h100")
    links, groups = Links(profile).data_parallel, layout_groups(config, profile, 8)
    s = tied_sum_s(config, links, groups, rank_params(config, rank))
    table = 131072 // 2 * 2048
    # the two ends are 32 ranks apart: on two nodes, one fp32 table over the link between them
    assert s == (pytest.approx(links.all_reduce(table * 4, (2, 1, 2))) if sums else 0.0)
    assert s == 0.0 or s > 2 * links.all_reduce(table * 4, (2, 2, 1))


def test_the_tied_sum_crosses_a_node_only_when_the_pipeline_does():
    config = config_for(dict(ROW, gpus=8, dp=2, tp=2, pp=2, grad_acc=64))
    profile = load_profile("playbook-h100")
    links, groups = Links(profile).data_parallel, layout_groups(config, profile, 8)
    table = 131072 // 2 * 2048
    assert tied_sum_s(config, links, groups, rank_params(config, 1)) == pytest.approx(
        links.all_reduce(table * 4, (2, 2, 1)))


@pytest.mark.parametrize("zero, steps", [(0, 2), (1, 1)])
@pytest.mark.parametrize("per_param, wire", [(4, "float32"), (4, "bfloat16"), (2, "float32")])
def test_each_bucket_pays_its_ring_steps_between_nodes(zero, steps, per_param, wire):
    # ZeRO-0 all-reduces each bucket (2 (k-1) steps), this project's ZeRO-1 reduce-scatters
    # it (k-1 steps); a bucket holds bucket_size_mb of parameters at the trainer's bytes a
    # parameter (this project's fp32 buffers, whatever the wire's dtype; torch DDP's bf16
    # gradients), so the wire's dtype does not change their number
    config = config_for(dict(ROW, tied=0, pp=1, dp=32, zero=zero))
    config.distributed.grad_reduce_dtype = wire
    profile = load_profile("playbook-h100").with_traits(zero1_reduce="reduce_scatter",
                                                        bucket_bytes_per_param=per_param)
    links, groups = Links(profile), layout_groups(config, profile, 8)
    rank = rank_params(config, 0)
    reduce = rank_collectives(config, profile, links, groups, rank)[0]
    latency = profile["dp_latency_s"]
    no_latency = profile.with_numbers(dp_latency_s=0.0)
    no_latency = rank_collectives(config, no_latency, Links(no_latency), groups, rank)[0]
    size, g, k = groups["cp_dp"]
    assert (g, k) == (4, 8)
    buckets = -(-rank.total * per_param // (25 * 2 ** 20))          # 25 MB buckets
    assert buckets > 10
    assert reduce - no_latency == pytest.approx(buckets * steps * (k - 1) * latency)


def test_a_trainer_that_shards_after_reducing_reduces_all_at_once_after_the_backward():
    # nanotron's ZeRO-1 (zero1_reduce "all_reduce") runs without DDP's hooks: one all-reduce
    # of the whole fp32 buffer after the last backward, which no backward hides and which
    # pays no bucket's latency; then the parameters' all-gather
    config = config_for(dict(ROW, tied=0, pp=1, dp=32, zero=1))
    profile = load_profile("playbook-h100")
    assert profile.traits["zero1_reduce"] == "all_reduce"
    groups, rank = layout_groups(config, profile, 8), rank_params(config, 0)
    for p in profile, profile.with_numbers(dp_latency_s=1.0):
        links = Links(p).data_parallel
        whole = links.all_reduce(rank.total * 4, groups["cp_dp"])
        gather = links.all_gather(rank.total * 2, groups["cp_dp"])
        assert tail(config, p, 0, last_backward=10.0) == pytest.approx(whole + gather)
    # in buckets during the backward (ZeRO-0), a long backward hides all but the last
    zero0 = config_for(dict(ROW, tied=0, pp=1, dp=32, zero=0))
    assert tail(zero0, profile, 0, last_backward=10.0) < whole / 2


def test_buckets_inside_one_node_pay_no_bucket_latency():
    config = config_for(dict(ROW, tied=0, gpus=8, pp=1, dp=4, grad_acc=64))
    profile = load_profile("playbook-h100")
    links, groups = Links(profile), layout_groups(config, profile, 8)
    rank = rank_params(config, 0)
    assert groups["cp_dp"][2] == 1
    slow = profile.with_numbers(dp_latency_s=1.0)
    assert rank_collectives(config, profile, links, groups, rank)[0] == rank_collectives(
        config, slow, Links(slow), groups, rank)[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_the_step_ends_collectives_step_at_the_networks_latency_not_a_layers(zero):
    # the gradients' reduction, the parameters' gather and the tied sum are the network's
    # collectives (dp_latency_s a ring step between nodes); inter_latency_s is the wait on a
    # layer's tensor-parallel collective, and moves none of them
    config = config_for(dict(ROW, pp=2, dp=16, zero=zero))
    profile = load_profile("playbook-h100")
    k = layout_groups(config, profile, 8)["cp_dp"][2]
    assert k == 4
    for rank in 0, 1:
        base = tail(config, profile, rank, last_backward=0.0)
        assert tail(config, profile.with_numbers(inter_latency_s=1.0), rank,
                    last_backward=0.0) == pytest.approx(base)
        later = profile.with_numbers(dp_latency_s=profile["dp_latency_s"] + 1.0)
        # ZeRO-0: its buckets' all-reduces, 2 (k-1) steps each; nanotron's ZeRO-1: one
        # all-reduce (2 (k-1)) and the gather (k-1); the tied sum: 2 steps between 2 nodes
        # nanotron's DDP buckets: 25 MB of bf16 gradients
        buckets = -(-rank_params(config, rank).total * 2 // (25 * 2 ** 20))
        steps = buckets * 2 * (k - 1) if zero == 0 else 3 * (k - 1)
        assert tail(config, later, rank, last_backward=0.0) == pytest.approx(base + steps + 2)


def test_zero3s_layer_gathers_step_at_the_networks_latency_too():
    # ZeRO-3 gathers each layer's parameters over cp x dp ahead of its pass: a data-parallel
    # collective, whose ring steps between nodes cost dp_latency_s, not inter_latency_s
    config = config_for(dict(ROW, tied=0, tp=1, pp=1, dp=64, zero=3, grad_acc=16))
    profile = load_profile("playbook-h100")
    groups = layout_groups(config, profile, 8)

    def exposed(p):
        part_f, part_b = layer_pass(config, p, Links(p), groups)[2:]
        return part_f["dp"], part_b["dp"]

    assert exposed(profile.with_numbers(inter_latency_s=1.0)) == exposed(profile)
    steps = groups["cp_dp"][2] - 1                          # an all-gather's, between nodes
    (f1, b1), (f2, b2) = (exposed(profile.with_numbers(dp_latency_s=s)) for s in (1.0, 2.0))
    # a second more a step: the forward's gather, and the backward's gather and reduce-scatter
    assert (f2 - f1, b2 - b1) == (pytest.approx(steps), pytest.approx(2 * steps))
