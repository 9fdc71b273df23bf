"""nanotron's own memory count (picotron/plan/nanotron_memory.py), which the playbook-h100
profile names with its trait memory = "nanotron": what it holds per parameter under ZeRO-0
and ZeRO-1 with and without data parallelism, the micro-batches its 1F1B keeps in flight on
each pipeline rank, the logits on the head's rank alone, and a layout judged by its busiest
rank. Each is checked against a count by hand or with the term set and unset. CPU only."""

import pytest

from picotron.plan.hardware import load_profile
from picotron.plan.layouts import config_for
from picotron.plan.memory_plan import rank_estimate
from picotron.plan.memory_state import GiB, layer_params
from picotron.plan.nanotron_memory import (busiest_need, layer_bytes, rank_blocks, rank_need,
                                           rank_parts)
from picotron.plan.step_lanes import rank_memory
from picotron.plan.step_time import predict
from picotron.plan.trainer_memory import counts_nanotron, memory_fit

LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336, vocab=131072,
                tied=0, seq=4096, gpus=64, gpus_per_node=8, dp=8, tp=2, pp=4, cp=1, zero=1,
                mbs=1, grad_acc=32, **{"distributed.sequence_parallel": "true"})
UNIT = dict(mem_held_factor=1.0, mem_act_factor=1.0, mem_logit_bytes=10.0, mem_extra_gib=0.0,
            mem_margin=0.0)


def nanotron():
    return load_profile("playbook-h100").with_numbers(**UNIT)


def rank_params(config, r):
    layers, embedding, head = rank_blocks(config, nanotron(), r)
    m = config.model
    table = m.vocab_size // config.distributed.tp_size * m.hidden_size
    return layers * layer_params(m, config.distributed.tp_size) + table * embedding + (
        table + m.hidden_size) * head


@pytest.mark.parametrize("dp, zero, per_param", [(1, 0, 2 + 4 + 12), (8, 0, 2 + 4 + 2 + 12),
                                                 (8, 1, 2 + 4 + 2 + 12 / 8)])
def test_held_bytes_a_parameter_follow_nanotrons_optimizer(dp, zero, per_param):
    # bf16 weights, the fp32 accumulator whole, DDP's bf16 buckets when dp > 1, and the fp32
    # master and two moments of the ZeRO shard
    config = config_for(dict(LLAMA_8B, gpus=dp * 8, dp=dp, zero=zero, grad_acc=256 // dp))
    for r in range(4):
        held = rank_parts(config, nanotron(), r).held
        assert held == pytest.approx(per_param * rank_params(config, r), rel=1e-12)


def test_the_first_rank_holds_a_micro_batch_for_each_stage_after_it():
    config = config_for(LLAMA_8B)
    one = config.training.seq_length * layer_bytes(config)
    for r in range(3):                          # no logits before the head's rank
        layers = rank_blocks(config, nanotron(), r)[0]
        parts = rank_parts(config, nanotron(), r)
        gathered = config.training.seq_length * 4096 * 2          # tp's all-gather buffer
        assert parts.logits == 0
        assert parts.rest == pytest.approx((4 - r) * layers * one + gathered, rel=1e-12)
    few = config_for(dict(LLAMA_8B, gpus=16, dp=2, grad_acc=2))   # 2 micro-batches a step
    layers = rank_blocks(few, nanotron(), 0)[0]
    assert rank_parts(few, nanotron(), 0).rest == pytest.approx(
        2 * layers * one + config.training.seq_length * 4096 * 2, rel=1e-12)


def test_only_the_heads_rank_keeps_logits_and_they_cost_their_bytes():
    config = config_for(dict(LLAMA_8B, mbs=4, grad_acc=8))
    logits = 4 * 4096 * 131072 // 2
    assert [rank_parts(config, nanotron(), r).logits for r in range(4)] == [0, 0, 0, logits]
    more = nanotron().with_numbers(mem_logit_bytes=16.0)
    last = rank_parts(config, nanotron(), 3)
    assert rank_need(last, more) - rank_need(last, nanotron()) == pytest.approx(6 * logits)


def test_a_layout_fits_by_its_busiest_rank_and_names_it():
    config = config_for(LLAMA_8B)
    needs = [rank_need(rank_parts(config, nanotron(), r), nanotron()) for r in range(4)]
    need, rank = busiest_need(config, nanotron())
    assert need == max(needs) and rank == needs.index(max(needs))
    tight = nanotron().with_numbers(memory_gib=need / GiB + 3.2 - 0.01)
    mem, fits, note = memory_fit(config, tight)
    assert mem == pytest.approx(need / GiB) and not fits and f"pipeline rank {rank}" in note
    assert predict(config, tight, 8, cache={}).mem_gib == pytest.approx(mem)


def test_the_count_is_the_profiles_trait_only():
    config = config_for(LLAMA_8B)
    profile = nanotron()
    plan = profile.with_traits(memory=None)
    # the plan's rule: each rank's estimate, the loss's logits on the head's (last) rank
    logits = 4096 * 131072 // 2
    needs = [rank_estimate(config, r).device_bytes for r in range(4)]
    needs[-1] += 10.0 * logits
    assert memory_fit(config, plan)[0] == pytest.approx(max(needs) / GiB, rel=1e-12)
    assert memory_fit(config, profile)[0] != memory_fit(config, plan)[0]


def test_explains_lanes_show_each_ranks_count():
    config = config_for(LLAMA_8B)
    profile = load_profile("playbook-h100")
    lanes = rank_memory(config, profile)
    for r, m in enumerate(lanes):
        parts = rank_parts(config, profile, r)
        assert m.device_bytes == pytest.approx(rank_need(parts, profile), rel=1e-12)
        assert m.held_bytes == pytest.approx(profile["mem_held_factor"] * parts.held)
    assert max(m.device_bytes for m in lanes) / GiB == pytest.approx(
        predict(config, profile, 8).mem_gib, rel=1e-12)


@pytest.mark.parametrize("change", [{"zero": 3}, {"zero": 3, "pp": 1, "dp": 32},
                                    {"recompute": "selective", "mbs": 4, "grad_acc": 8}])
def test_explains_lanes_show_the_plans_rule_as_the_profile_scales_it(change):
    # a layout outside nanotron's count: each rank's bar is the memory plan's estimate of
    # it, scaled as the profile scales it, the trainer's logits on the head's rank alone, and
    # the busiest bar is the figure the prediction (its header, its search row) judges by
    config = config_for(dict(LLAMA_8B, **change))
    profile = load_profile("playbook-h100")
    assert not counts_nanotron(config, profile)
    lanes, pp = rank_memory(config, profile), config.distributed.pp_size
    logits = profile["mem_logit_bytes"] * config.training.micro_batch_size * 4096 * 131072 // 2
    for r, m in enumerate(lanes):
        e = rank_estimate(config, r)
        held = sum(row.bytes for row in e.rows if row.when == "held")
        need = (profile["mem_held_factor"] * held + profile["mem_act_factor"] * (
            e.device_bytes - held) + profile["mem_extra_gib"] * GiB)
        assert m.device_bytes == pytest.approx(need + (logits if r == pp - 1 else 0), rel=1e-12)
        assert m.held_bytes == pytest.approx(profile["mem_held_factor"] * held, rel=1e-12)
    for cache in (None, {}):
        assert max(m.device_bytes for m in lanes) / GiB == pytest.approx(
            predict(config, profile, 8, cache=cache).mem_gib, rel=1e-12)


@pytest.mark.parametrize("change, counted", [
    ({}, True), ({"zero": 3}, False), ({"cp": 2, "dp": 4}, False), ({"fp8": "tensorwise"}, False),
    ({"recompute": "selective"}, False), ({"pp_engine": "interleaved:2", "layers": 32}, False),
    ({"pp_engine": "afab"}, True), ({"distributed.offload_optim_frac": "0.5"}, False)])
def test_what_nanotron_does_not_do_keeps_the_plans_rule(change, counted):
    config = config_for(dict(LLAMA_8B, **change))
    assert counts_nanotron(config, nanotron()) == counted
