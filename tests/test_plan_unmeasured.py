"""Layouts beyond a profile's runs (hardware.unmeasured): a profile names, by its trait
measured, the knob values the runs it was fit to had; the search marks a row outside them "*"
with a footnote and names the fastest layout within them, and --auto_layout says the same of
its choice. The profiles' own traits are read as shipped."""
import types
from collections import Counter

from picotron.plan.hardware import load_profile, unmeasured
from picotron.plan.report import search_report
from picotron.plan.search import Scored

PLAIN = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "cp_mode": "ring", "zero": 1, "mbs": 1,
         "grad_acc": 4, "recompute": "none", "fp8": "none", "pp_engine": "1f1b",
         "interleave": 2}


def scored(tok_s: float, **knobs) -> Scored:
    prediction = types.SimpleNamespace(tok_s_gpu=tok_s, mfu=0.4, mem_gib=30.0, step_s=1.0,
                                       parts={}, fits=True, note="")
    return Scored({**PLAIN, **knobs}, prediction)


def test_the_playbook_profile_names_what_its_runs_never_had():
    profile = load_profile("playbook-h100")
    assert unmeasured(profile, PLAIN) == []
    assert unmeasured(profile, {**PLAIN, "zero": 3, "fp8": "rowwise"}) == [
        ("zero", 3), ("fp8", "rowwise")]
    # an engine or a cp mode that does not act is not judged
    assert unmeasured(profile, {**PLAIN, "pp_engine": "afab"}) == []
    assert unmeasured(profile, {**PLAIN, "pp": 2, "pp_engine": "afab"}) == [
        ("pp_engine", "afab")]


def test_the_one_gpu_profile_never_measured_a_second_gpu():
    profile = load_profile("h200")
    one = {**PLAIN, "dp": 1, "recompute": "selective"}
    assert unmeasured(profile, one) == []
    assert unmeasured(profile, {**one, "tp": 2}) == [("tp", 2)]


def test_search_marks_the_rows_beyond_and_names_the_fastest_within():
    profile = load_profile("playbook-h100")
    result = types.SimpleNamespace(
        ranked=[scored(300, zero=3), scored(200, recompute="full", fp8="tensorwise"),
                scored(100), scored(50, zero=3)],
        refused=Counter(), examples={}, considered=4, seconds=0.1)
    lines = search_report(result, top=3, profile=profile).splitlines()
    ranks = [line.split()[0] for line in lines[1:4]]
    assert ranks == ["1*", "2*", "3"]
    footnote = next(line for line in lines if line.startswith("* "))
    assert footnote.startswith("* zero 3; recompute full; fp8 tensorwise: beyond the runs the "
                               "playbook-h100 profile was fit to")
    within = next(line for line in lines if line.startswith("fastest within them"))
    assert within.startswith("fastest within them: #3, dp8 tp1 pp1 cp1")
    assert "100 tok/s/GPU" in within


def test_rows_within_the_runs_are_not_marked_and_need_no_footnote():
    profile = load_profile("playbook-h100")
    result = types.SimpleNamespace(ranked=[scored(300), scored(200, zero=3)], refused=Counter(),
                                   examples={}, considered=2, seconds=0.1)
    report = search_report(result, top=1, profile=profile)
    assert "*" not in report and "fastest within" not in report
    assert search_report(result, top=2, profile=profile).count("\n* zero 3") == 1
