"""The search's fast path (step_time.predict_many: the pieces layouts share computed once in a
cache keyed by the knobs each reads, the pipeline simulations of one schedule run as one
batch) predicts exactly what step_time.predict says of each config alone: every row's
prediction to the last bit, the same refusals counted alike, the same ranking, the same
timelines; and a search shared with a forked process gives what one process does.
bench/plan_search_speed.py times it."""
import os

import pytest

from picotron.config import Config
from picotron.config.presets import resolve_model
from picotron.plan.hardware import load_profile
from picotron.plan.search import search
from picotron.plan.step_time import predict

# small enough that predict alone, layout by layout, takes seconds
SMALL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 1024}


def raw_config(model: dict, seq: int) -> dict:
    raw = Config().to_dict()
    raw["model"].update(model)
    raw["training"]["seq_length"] = seq
    return raw


def ticks(profile):
    """The profile with the pipeline run in this project's ticks (pipeline_sim.py)."""
    return profile.with_traits(pp_mode="ticks")


def outcome(result) -> tuple:
    rows = [(tuple(s.layout.items()), s.prediction.step_s, s.prediction.tok_s_gpu,
             s.prediction.mfu, s.prediction.mem_gib, s.prediction.fits, s.prediction.note,
             tuple(s.prediction.parts.items())) for s in result.ranked]
    return (rows, list(result.refused.items()), list(result.examples.items()),
            result.considered, [(tuple(layout.items()), message)
                                for layout, message in result.refused_layouts])


@pytest.mark.parametrize("model, seq, gpus, sequences, profile", [
    (SMALL, 256, 8, 16, "playbook-h100"),        # the grids of two nodes' ranks, FP8 on and off
    (SMALL, 256, 4, 8, "h200"),
    ("SmolLM-135M", 1024, 1, 4, "h200"),        # one GPU: CUDA graphs where "auto" takes them
    (SMALL, 256, 4, 8, "ticks"),
    (SMALL, 256, 4, 8, "tight")])       # about half refused on memory alone, untimed
def test_the_fast_path_predicts_what_predict_alone_does(model, seq, gpus, sequences, profile):
    hardware = load_profile("h200" if profile in ("ticks", "tight") else profile)
    if profile == "ticks":
        hardware = ticks(hardware)
    if profile == "tight":      # 3.275 GiB less the CUDA context's 3.2: about half fit
        hardware = hardware.with_numbers(memory_gib=3.275)
    raw = raw_config(resolve_model(model) if isinstance(model, str) else model, seq)
    fast = search(raw, gpus, sequences * seq, hardware, gpus_per_node=2, keep_refused=True)
    alone = search(raw, gpus, sequences * seq, hardware, gpus_per_node=2, keep_refused=True,
                   predict=predict)
    assert fast.ranked and outcome(fast) == outcome(alone)
    if profile == "tight":      # the refusals by memory alone are among those compared
        assert any("needs an estimated" in message for message in fast.examples.values())
    for i in range(0, len(fast.ranked), max(1, len(fast.ranked) // 7)):
        assert list(fast.ranked[i].prediction.timeline) == list(
            alone.ranked[i].prediction.timeline)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this system")
@pytest.mark.parametrize("model, seq, gpus, sequences, profile", [
    (SMALL, 256, 8, 16, "playbook-h100"), (SMALL, 256, 16, 32, "h200")])
def test_a_search_shared_with_a_second_process_gives_what_one_process_does(
        model, seq, gpus, sequences, profile):
    """The grids dealt by pp between this process and a forked child (share_work.py): the
    same rows, refusals and timelines, in the same order."""
    raw, hardware = raw_config(model, seq), load_profile(profile)
    one = search(raw, gpus, sequences * seq, hardware, gpus_per_node=2, keep_refused=True,
                 processes=1)
    two = search(raw, gpus, sequences * seq, hardware, gpus_per_node=2, keep_refused=True,
                 processes=2)
    assert (one.processes, two.processes) == (1, 2)
    assert one.ranked and outcome(two) == outcome(one)
    for i in range(0, len(one.ranked), max(1, len(one.ranked) // 7)):
        assert list(two.ranked[i].prediction.timeline) == list(
            one.ranked[i].prediction.timeline)
