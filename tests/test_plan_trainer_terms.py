"""The time model's terms for a trainer other than this one (a profile fit to its runs): its
memory from the memory plan's parts scaled by the profile's factors and the margin it must
leave free, a micro-batch's host
cost, a pipeline send's hand-shake, and a ring's latency across nodes. Each
is checked against the model's own parts with the term set and unset, so a term that stopped
reaching the prediction fails here. CPU only: the model is arithmetic."""

import pytest

from picotron.plan.comm_time import Links
from picotron.plan.hardware import load_profile
from picotron.plan.layouts import config_for
from picotron.plan.memory_plan import GPU_RESERVED, estimate
from picotron.plan.memory_state import GiB
from picotron.plan.step_time import predict
from picotron.plan.trainer_memory import need_fit

ROW = dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=8192, tied=0, seq=1024,
           gpus=16, gpus_per_node=8, dp=2, tp=2, pp=2, cp=2, zero=1, mbs=2, grad_acc=4)
PLAIN = dict(mem_held_factor=1.0, mem_act_factor=1.0, mem_logit_bytes=0.0, mem_extra_gib=0.0,
             micro_s=0.0, send_s=0.0, mem_margin=0.0, stall_s=0.0)


def plain_profile():
    """playbook-h100 with every trainer term at this project's value, its memory the memory
    plan's (not nanotron's own count: tests/test_plan_nanotron_memory.py)."""
    profile = load_profile("playbook-h100").with_numbers(**PLAIN)
    return profile.with_traits(memory=None)


def test_this_projects_profile_reports_the_memory_plans_estimate():
    profile = load_profile("h200")
    assert all(profile[k] == v for k, v in PLAIN.items())


def test_another_trainers_memory_is_the_plans_parts_scaled():
    config = config_for(ROW)
    e = estimate(config)
    held = sum(r.bytes for r in e.rows if r.when == "held")
    logits = 2 * 1024 // 2 * 8192 // 2          # mbs x seq / cp x vocab / tp
    factors = dict(mem_held_factor=1.7, mem_act_factor=0.4, mem_logit_bytes=12.0,
                   mem_extra_gib=0.5)
    got = predict(config, plain_profile().with_numbers(**factors), 8).mem_gib
    want = (1.7 * held + 0.4 * (e.device_bytes - held) + 12.0 * logits) / GiB + 0.5
    assert got == pytest.approx(want, rel=1e-12)
    assert predict(config, plain_profile(), 8).mem_gib == e.device_bytes / GiB


def test_a_micro_batchs_host_cost_reaches_every_stage_pass():
    # 4 micro-batches, pp 2, 1F1B: each of the (m + p - 1) slots of the critical path holds
    # one forward and one backward, each longer by micro_s
    config = config_for(ROW)
    base = predict(config, plain_profile(), 8)
    slow = predict(config, plain_profile().with_numbers(micro_s=0.01), 8)
    assert slow.step_s - base.step_s == pytest.approx((4 + 2 - 1) * 2 * 0.01, rel=1e-6)


def test_a_sends_handshake_lengthens_a_pipeline_but_not_one_stage():
    deep, flat = config_for(ROW), config_for(dict(ROW, pp=1, dp=4))
    for config, grows in ((deep, True), (flat, False)):
        base = predict(config, plain_profile(), 8).step_s
        slow = predict(config, plain_profile().with_numbers(send_s=0.01), 8).step_s
        assert (slow > base) == grows and slow >= base


def test_ring_latency_across_nodes_grows_with_the_nodes_it_spans():
    links = Links(plain_profile().with_numbers(inter_bytes_per_s=1e30, inter_latency_s=1e-3,
                                                intra_latency_s=0.0))
    # (size, ranks a node, nodes): an all-gather's latency is one step a node it crosses
    assert links.all_gather(1, (16, 1, 16)) == pytest.approx(15e-3)
    assert links.all_gather(1, (4, 1, 4)) == pytest.approx(3e-3)



def test_a_layout_must_leave_the_profiles_margin_free_to_fit():
    config = config_for(ROW)
    need = predict(config, plain_profile(), 8).mem_gib
    usable = plain_profile()["memory_gib"] - GPU_RESERVED / GiB
    just_fits = plain_profile().with_numbers(mem_margin=0.99 * (1 - need / usable))
    too_tight = plain_profile().with_numbers(mem_margin=1.01 * (1 - need / usable))
    assert predict(config, just_fits, 8).fits
    refused = predict(config, too_tight, 8)
    assert not refused.fits and "GiB usable" in refused.note


def test_a_refusal_never_reads_as_needing_what_the_gpu_has():
    # a need a hair over the room would print as the room itself at one decimal: the note
    # rounds the need up and the room down
    profile = plain_profile()
    room = (profile["memory_gib"] * GiB - GPU_RESERVED) * (1 - profile["mem_margin"])
    for over in (1, 0.04 * GiB, 0.06 * GiB, 3.3 * GiB):
        gib, fits, note = need_fit(room + over, profile)
        said = [float(w) for w in note.split() if w.replace(".", "", 1).isdigit()]
        assert not fits and len(said) == 2 and said[0] > said[1]
        assert said[0] - gib < 0.1 + 1e-9 and room / GiB - said[1] < 0.1 + 1e-9
