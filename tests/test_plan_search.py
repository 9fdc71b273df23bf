"""The layout search (picotron/plan/search.py): exhaustive over what the config accepts, held to
a brute-force filter that tries every value of every knob through config_from_dict itself;
refusals carry the config's own message; fixed knobs stay fixed; the ranking follows the
prediction. The step-time model is a stub here (its own tests are tests/test_plan_model.py):
what the search owes is which layouts it scores, not their times."""
import itertools
import types

import pytest

from picotron.config import Config, ConfigError, config_from_dict
from picotron.config.checks import CHECKPOINTING, CP_MODES, PP_ENGINES
from picotron.plan.report import search_report
from picotron.plan.search import LAYOUT_KEYS, fp8_options, search

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# heads 6: tp 4 divides no head count; 6 layers: pp 4 cuts none into equal chunks
ODD = {**TINY, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6,
       "num_hidden_layers": 6, "intermediate_size": 192}
GPUS, SEQ, SEQUENCES = 4, 32, 4
FP8_PROFILE = types.SimpleNamespace(numbers={"peak_fp8_flops": 1.0}, traits={})


def stub_predict(config, profile, gpus_per_node):
    """Faster with more dp, slower with recomputation; ZeRO-0 with full recompute 'does not
    fit' (a refusal of the model's, with its note)."""
    d, t = config.distributed, config.training
    fits = not (d.zero_stage == 0 and t.activation_checkpointing == "full")
    return types.SimpleNamespace(tok_s_gpu=d.dp_size * 100 - d.zero_stage
                                 - 10 * (t.activation_checkpointing != "none"),
                                 mem_gib=1.0 + t.micro_batch_size, fits=fits,
                                 note="" if fits else f"needs {7 + d.dp_size} GiB", step_s=1.0,
                                 mfu=0.5, parts={})


def base_raw(model, overrides=None) -> dict:
    raw = Config().to_dict()
    raw["model"].update(model)
    raw["training"]["seq_length"] = SEQ
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        raw[section][name] = value
    return raw


def canonical(layout: dict, defaults=("ring", "1f1b", 2)) -> tuple:
    """One layout, with the knobs that mean nothing for it at their defaults."""
    layout = dict(layout)
    if layout["cp"] == 1:
        layout["cp_mode"] = defaults[0]
    if layout["pp"] == 1:
        layout["pp_engine"] = defaults[1]
    if layout["pp_engine"] != "interleaved" or layout["pp"] == 1:
        layout["interleave"] = defaults[2]
    return tuple(layout[k] for k in LAYOUT_KEYS)


def brute_force(raw: dict, fp8: tuple, fixed=None) -> set:
    """Every combination of every knob's values, each through config_from_dict: the canonical
    layouts it accepts."""
    fixed = fixed or {}
    accepted = set()
    sizes = range(1, GPUS + 1)
    for dp, tp, pp, cp in itertools.product(sizes, sizes, sizes, sizes):
        if dp * tp * pp * cp != GPUS:
            continue
        for mbs, acc in itertools.product(range(1, SEQUENCES + 1), repeat=2):
            if dp * mbs * acc != SEQUENCES:
                continue
            for mode, zero, engine, v, recompute, recipe in itertools.product(
                    CP_MODES, range(4), PP_ENGINES, range(1, raw["model"]["num_hidden_layers"]
                                                          + 2),
                    [c for c in CHECKPOINTING if c != "auto"], fp8):
                layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "cp_mode": mode,
                          "zero": zero, "mbs": mbs, "grad_acc": acc, "recompute": recompute,
                          "fp8": recipe, "pp_engine": engine, "interleave": v}
                if any(layout[k] != value for k, value in fixed.items()):
                    continue
                if canonical(layout) in accepted:
                    continue
                trial = {section: dict(values) for section, values in raw.items()}
                for name, (section, key) in LAYOUT_KEYS.items():
                    trial[section][key] = layout[name]
                try:
                    config_from_dict(trial, world_size=GPUS)
                except ConfigError:
                    continue
                accepted.add(canonical(layout))
    return accepted


def scored_set(result) -> set:
    return {canonical(s.layout) for s in result.ranked} | {
        canonical(layout) for layout, message in result.refused_layouts
        if message.startswith("needs ")}


@pytest.mark.parametrize("model, overrides", [
    (TINY, {}), (ODD, {}),
    # zero3_keep_params is refused at ZeRO 0-2 and accepted at 3: a grid refused at one end of
    # its layouts only must still be judged layout by layout
    (TINY, {"distributed.zero3_keep_params": True}),
    (TINY, {"distributed.sequence_parallel": True, "training.fused_loss": "none"})])
def test_search_is_exhaustive_over_what_the_config_accepts(model, overrides):
    raw = base_raw(model, overrides)
    fp8 = fp8_options(FP8_PROFILE)
    assert fp8 == ("none", "tensorwise_delayed")
    result = search(raw, GPUS, SEQUENCES * SEQ, FP8_PROFILE, predict=stub_predict,
                    keep_refused=True)
    expected = brute_force(raw, fp8)
    assert expected and scored_set(result) == expected
    assert len({canonical(s.layout) for s in result.ranked}) == len(result.ranked)
    assert len(result.ranked) + sum(result.refused.values()) >= result.considered


def test_fixed_knobs_stay_fixed_and_the_rest_is_still_exhaustive():
    raw = base_raw(TINY)
    fixed = {"tp": 2, "zero": 1}
    result = search(raw, GPUS, SEQUENCES * SEQ, FP8_PROFILE, fixed=fixed, predict=stub_predict,
                    keep_refused=True)
    assert result.ranked and all(s.layout["tp"] == 2 and s.layout["zero"] == 1
                                 for s in result.ranked)
    assert scored_set(result) == brute_force(raw, fp8_options(FP8_PROFILE), fixed)


def test_refusals_carry_the_configs_own_message():
    raw = base_raw(ODD)
    result = search(raw, GPUS, SEQUENCES * SEQ, FP8_PROFILE, predict=stub_predict,
                    keep_refused=True)
    refused = [(layout, m) for layout, m in result.refused_layouts if "dp" in layout
               and "zero" in layout and not m.startswith("needs ")]
    assert len(refused) > 10
    for layout, message in refused[::7]:
        trial = {section: dict(values) for section, values in raw.items()}
        for name, (section, key) in LAYOUT_KEYS.items():
            trial[section][key] = layout[name]
        with pytest.raises(ConfigError) as error:
            config_from_dict(trial, world_size=GPUS)
        assert message in str(error.value)
    # counted by reason, numbers masked: tp 4 against 6 heads is one reason, with its message
    reasons = [k for k in result.refused if "num_attention_heads=N is not divisible" in k]
    assert reasons and "num_attention_heads=6" in result.examples[reasons[0]]
    assert any(k.startswith("needs N GiB") for k in result.refused)


def test_ranked_fastest_first_and_the_batch_is_the_global_batch():
    result = search(base_raw(TINY), GPUS, SEQUENCES * SEQ, FP8_PROFILE, predict=stub_predict)
    speeds = [s.prediction.tok_s_gpu for s in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(s.layout["dp"] * s.layout["mbs"] * s.layout["grad_acc"] == SEQUENCES
               for s in result.ranked)
    assert result.ranked[0].layout["dp"] == GPUS


def test_no_fp8_without_fp8_tensor_cores_and_a_batch_that_is_not_whole_sequences():
    assert fp8_options(types.SimpleNamespace(numbers={}, traits={})) == ("none",)
    with pytest.raises(ConfigError, match="multiple of it"):
        search(base_raw(TINY), GPUS, SEQ * SEQUENCES + 1, FP8_PROFILE, predict=stub_predict)


def test_a_tensor_parallel_group_across_nodes_is_refused_as_a_launch_refuses_it():
    # 4 GPUs as 4 nodes of 1: tp 2 would span two nodes, which the launch refuses
    # (check_nodes); with the 4 in one node it is scored
    raw = base_raw(TINY)
    apart = search(raw, GPUS, SEQUENCES * SEQ, FP8_PROFILE, gpus_per_node=1,
                   predict=stub_predict, keep_refused=True)
    together = search(raw, GPUS, SEQUENCES * SEQ, FP8_PROFILE, gpus_per_node=4,
                      predict=stub_predict)
    assert not any(s.layout["tp"] > 1 for s in apart.ranked) and apart.ranked
    assert any(s.layout["tp"] == 2 for s in together.ranked)
    said = {m for layout, m in apart.refused_layouts if layout["tp"] == 2}
    assert said and all("tp_size=2 does not divide the 1 processes (GPUs) per node" in m
                        for m in said)


def test_the_report_gives_a_memory_refusals_estimates_as_their_range():
    # each layout that does not fit needs its own amount: the line counting them shows the
    # least and greatest of them, not the first layout's alone; a rule's integers stay the
    # first message's
    def needs_by_layout(config, profile, gpus_per_node):
        d, t = config.distributed, config.training
        need = 10.0 + 1.25 * d.dp_size + 0.5 * t.micro_batch_size
        return types.SimpleNamespace(tok_s_gpu=1.0, mem_gib=need, fits=False, step_s=1.0,
                                     note=f"needs an estimated {need:.1f} GiB per GPU, the GPU "
                                          f"has 8.0 GiB usable", mfu=0.5, parts={})
    result = search(base_raw(ODD), GPUS, SEQUENCES * SEQ, FP8_PROFILE,
                    predict=needs_by_layout, keep_refused=True)
    needs = sorted(float(m.split()[3]) for _, m in result.refused_layouts
                   if m.startswith("needs an estimated"))
    assert len(set(needs)) > 2
    lines = search_report(result).splitlines()
    count = sum(m.startswith("needs an estimated") for _, m in result.refused_layouts)
    assert (f"  {count:>9,}  needs an estimated {needs[0]:.1f}-{needs[-1]:.1f} GiB per GPU, "
            "the GPU has 8.0 GiB usable") in lines
    heads = [k for k in result.refused if "num_attention_heads=N is not divisible" in k][0]
    assert f"  {result.refused[heads]:>9,}  {result.examples[heads]}" in lines
