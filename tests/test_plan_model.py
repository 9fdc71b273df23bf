"""The planner's time model (picotron/plan/step_time.py and the modules behind it): the
simulated pipeline against the bubble's closed form where the closed form holds, the memory
it reports against the memory plan's, refusals passed through with the config's own words,
and the profiles' errors. CPU only, no process group: the model is arithmetic."""
import pytest

from picotron.errors import ConfigError
from picotron.plan.hardware import known_profiles, load_profile
from picotron.plan.layouts import LAYOUT_COLUMNS, config_for, row_of
from picotron.plan.memory_plan import estimate
from picotron.plan.memory_state import GiB
from picotron.plan.pipeline_sim import idle_share, simulate
from picotron.plan.step_time import PARTS, predict

ROW = dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=8192, tied=0, seq=1024,
           gpus=16, gpus_per_node=8, dp=2, tp=2, pp=2, cp=2, zero=1, mbs=2, grad_acc=4)


@pytest.mark.parametrize("mode", ["async", "ticks"])
@pytest.mark.parametrize("engine", ["afab", "1f1b"])
@pytest.mark.parametrize("pp,micro", [(2, 1), (4, 8), (8, 3), (4, 16)])
def test_equal_stages_idle_share_is_the_bubble(engine, mode, pp, micro):
    # equal stages, no send time: (p - 1) / (m + p - 1) of the ranks' time is idle. The ticks
    # engine runs a forward and a backward in the same tick, so they take the same time there
    back = 2.0 if mode == "async" else 1.0
    sim = simulate(engine, pp, micro, 1, [1.0] * pp, [back] * pp, 0.0, mode)
    assert idle_share(sim) == pytest.approx((pp - 1) / (micro + pp - 1), rel=1e-9)
    assert sim.makespan_s == pytest.approx((micro + pp - 1) * (1.0 + back))


@pytest.mark.parametrize("mode", ["async", "ticks"])
@pytest.mark.parametrize("pp,micro,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 2)])
def test_interleaved_idle_share_is_smaller_by_its_factor(mode, pp, micro, v):
    # v chunks a rank, each 1/v of the stage: the fill and drain take 1/v as long, so the
    # idle share is (p - 1) / (v m + p - 1), below 1F1B's (p - 1) / (m + p - 1)
    stages = pp * v
    sim = simulate("interleaved", pp, micro, v, [1.0 / v] * stages, [1.0 / v] * stages, 0.0,
                   mode)
    assert idle_share(sim) == pytest.approx((pp - 1) / (v * micro + pp - 1), rel=1e-9)
    plain = simulate("1f1b", pp, micro, 1, [1.0] * pp, [1.0] * pp, 0.0, mode)
    assert idle_share(sim) < idle_share(plain)


def test_send_time_lengthens_the_step_and_shows_in_the_timeline():
    quick = simulate("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4, 0.0)
    slow = simulate("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4, 0.5)
    assert slow.makespan_s > quick.makespan_s
    kinds = {event[1] for event in slow.timeline}
    assert {"F", "B", "send", "idle"} <= kinds
    per_rank = {r: sum(e[5] - e[4] for e in slow.timeline if e[0] == r and e[1] in "FB")
                for r in range(4)}
    assert per_rank == pytest.approx({r: 8 * 3.0 for r in range(4)})


# this project's own profile; another trainer's memory is the plan's parts scaled by its
# profile (tests/test_plan_trainer_terms.py)
@pytest.mark.parametrize("profile", ["h200"])
@pytest.mark.parametrize("changes", [{}, {"zero": 3}, {"pp_engine": "afab"},
                                     {"pp_engine": "interleaved:2", "grad_acc": 4},
                                     {"recompute": "full", "distributed.cp_mode": "ulysses"}])
def test_memory_is_the_memory_plans(profile, changes):
    config = config_for({**ROW, **changes})
    prediction = predict(config, load_profile(profile), ROW["gpus_per_node"])
    assert prediction.mem_gib == estimate(config).device_bytes / GiB
    assert prediction.fits and prediction.note == ""
    assert prediction.step_s > 0 and set(PARTS) <= set(prediction.parts)
    assert prediction.tok_s_gpu == pytest.approx(
        config.global_batch_size * ROW["seq"] / prediction.step_s / ROW["gpus"])


def test_too_large_for_the_gpu_does_not_fit_and_says_why():
    big = dict(ROW, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
               gpus=8, dp=1, tp=1, pp=1, cp=8, zero=0)
    prediction = predict(config_for(big), load_profile("h200"), 8)
    assert not prediction.fits and "GiB" in prediction.note


@pytest.mark.parametrize("speed", [1.0, 0.25])
def test_a_layout_past_its_memory_runs_at_the_profiles_over_memory_speed(speed):
    # at the GPU's capacity the allocator frees and retries: the step is the time model's
    # over over_memory_speed, the extra in its own part; a layout that fits is untouched
    big = dict(ROW, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
               gpus=8, dp=1, tp=1, pp=1, cp=8, zero=0)
    profile = load_profile("h200")
    base = predict(config_for(big), profile.with_numbers(over_memory_speed=1.0), 8)
    slow = predict(config_for(big), profile.with_numbers(over_memory_speed=speed), 8)
    assert not slow.fits and base.parts["memory_pressure"] == 0.0
    assert slow.step_s == pytest.approx(base.step_s / speed)
    assert slow.tok_s_gpu == pytest.approx(base.tok_s_gpu * speed)
    assert sum(slow.parts.values()) == pytest.approx(slow.step_s)
    fits = predict(config_for(ROW), profile.with_numbers(over_memory_speed=speed), 8)
    assert fits.fits and fits.parts["memory_pressure"] == 0.0
    assert fits.step_s == predict(config_for(ROW), profile, 8).step_s


@pytest.mark.parametrize("changes,words", [
    ({"tp": 3, "dp": 1, "gpus": 12}, "not divisible by tp_size=3"),
    ({"gpus": 12}, "but 12 processes were launched")])
def test_a_refused_layout_raises_the_configs_own_message(changes, words):
    with pytest.raises(ConfigError) as refused:
        config_for({**ROW, **changes})
    assert words in str(refused.value)


def test_a_row_without_a_column_names_it():
    with pytest.raises(ValueError, match="the row has no mbs, grad_acc"):
        config_for({k: v for k, v in ROW.items() if k not in ("mbs", "grad_acc")})


def test_row_of_inverts_config_for():
    row = {**ROW, "recompute": "full", "fp8": "none", "pp_engine": "interleaved:2"}
    assert row_of(config_for(row), ROW["gpus_per_node"]) == row
    assert set(LAYOUT_COLUMNS) <= set(row)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError) as unknown:
        load_profile("h300")
    assert set(known_profiles()) >= {"h200", "playbook-h100"}
    for name in known_profiles():
        assert name in str(unknown.value)


def test_a_group_spanning_nodes_is_slower():
    # the same layout, dp's group inside one node against across 8 nodes
    config = config_for(dict(ROW, gpus=8, dp=8, tp=1, pp=1, cp=1, zero=1))
    profile = load_profile("playbook-h100")
    inside = predict(config, profile, gpus_per_node=8)
    across = predict(config, profile, gpus_per_node=1)
    assert across.parts["dp"] > inside.parts["dp"]
    assert across.step_s > inside.step_s


@pytest.mark.parametrize("zero", [0, 3])
def test_full_recomputation_reruns_the_forwards_collectives_and_launches(zero):
    # the backward runs each layer's forward again: its tensor-parallel collectives (three
    # directions a layer where there were two, exposed without overlap) and, where the host's
    # launches bound the passes, its launches (three a layer where there were two)
    row = dict(ROW, gpus=4, dp=1, tp=4, pp=1, cp=1, zero=zero, mbs=1, grad_acc=1)

    def predicted(profile):
        return [predict(config_for(dict(row, recompute=r)), profile, 8) for r in ("none", "full")]
    plain, full = predicted(load_profile("playbook-h100"))
    assert full.parts["tp"] == pytest.approx(1.5 * plain.parts["tp"], rel=1e-9)
    plain, full = predicted(load_profile("playbook-h100").with_numbers(launch_s=1.0))
    assert full.step_s - plain.step_s == pytest.approx(row["layers"] * 1.0, rel=1e-6)
