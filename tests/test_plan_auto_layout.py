"""`python create_config.py --auto_layout --gpus N ...` (picotron/plan/auto_layout.py): the
flags given stay fixed, the written config is the search's top row for the same model, batch
and fixed knobs, the choice and the runner-up are printed, and a constraint no layout meets
(or an --auto_layout flag without --auto_layout) ends in one line."""
import json
from collections import Counter

import pytest

import create_config
from picotron.plan.auto_layout import nothing_fits
from picotron.plan.hardware import load_profile
from picotron.plan.search import LAYOUT_KEYS, SearchResult, search, search_raw

GPUS, SEQ, TOKENS = 4, 64, 512          # the debug model, 8 sequences a step


def auto_layout(tmp_path, flags) -> dict:
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "auto", "--auto_layout",
                               "--gpus", str(GPUS), "--seq_len", str(SEQ), "--global_batch_tokens",
                               str(TOKENS), "--hardware", "h200"] + flags)
    with open(path) as f:
        return json.load(f)


def knobs(config: dict) -> dict:
    return {knob: config[section][key] for knob, (section, key) in LAYOUT_KEYS.items()}


@pytest.mark.parametrize("flags, fixed", [
    ([], {}),
    (["--tp", "2", "--zero_stage", "1", "--mbs", "2"], {"tp": 2, "zero": 1, "mbs": 2}),
    (["--pp", "2", "--pp_engine", "1f1b", "--set", "training.activation_checkpointing=full"],
     {"pp": 2, "pp_engine": "1f1b", "recompute": "full"}),
])
def test_the_written_config_is_the_searchs_top_row_with_the_flags_kept(tmp_path, capsys,
                                                                      flags, fixed):
    written = knobs(auto_layout(tmp_path, flags))
    assert {k: written[k] for k in fixed} == fixed
    result = search(search_raw("debug", SEQ), GPUS, TOKENS, load_profile("h200"), 8,
                    fixed=fixed)
    best, second = result.ranked[:2]
    assert written == best.layout
    err = capsys.readouterr().err
    assert f"{best.prediction.tok_s_gpu:,.0f} tok/s/GPU" in err
    loss = 100 * (1 - second.prediction.tok_s_gpu / best.prediction.tok_s_gpu)
    assert "runner-up: " in err and f"{loss:.1f}% slower than the best" in err
    # h200's runs are one GPU's: a layout of several is beyond them, and the choice says so
    assert "note: " in err and "beyond the runs the h200 profile was fit to" in err


def one_error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        create_config.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_an_impossible_constraint_ends_in_one_line(tmp_path, capsys):
    base = ["--out_dir", str(tmp_path), "--auto_layout", "--gpus", "4", "--seq_len", "64",
            "--global_batch_tokens", "512", "--hardware", "h200"]
    err = one_error_line(capsys, base + ["--tp", "3"])            # 8 heads over 3 shards
    assert "no layout of 4 GPUs" in err and "tp=3" in err
    err = one_error_line(capsys, base + ["--dp", "8"])
    assert "must multiply to --gpus 4" in err
    err = one_error_line(capsys, base[:5] + ["--seq_len", "64"])
    assert "--global_batch_tokens" in err
    assert not list(tmp_path.iterdir())


def test_auto_layout_flags_without_it_are_refused(tmp_path, capsys):
    err = one_error_line(capsys, ["--out_dir", str(tmp_path), "--gpus", "8"])
    assert "--gpus apply only with --auto_layout" in err


def test_with_slurm_the_gpus_are_the_allocations(tmp_path, capsys):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "auto", "--auto_layout",
                               "--seq_len", "64", "--global_batch_tokens", "512", "--hardware",
                               "h200", "--slurm", "--nodes", "2", "--gpus_per_node", "2",
                               "--partition", "gpu", "--time", "01:00:00"])
    with open(path) as f:
        written = knobs(json.load(f))
    assert written["dp"] * written["tp"] * written["pp"] * written["cp"] == 4
    assert "auto_layout: 4 GPUs (2 per node" in capsys.readouterr().err
    assert (tmp_path / "auto" / "slurm.sh").is_file()


def test_nothing_fits_says_the_memory_its_layouts_need_as_a_range():
    key = "needs an estimated N GiB per GPU, the h200 GPU has N GiB usable"
    result = SearchResult([], Counter({key: 12}), {key: key.replace("N", "90.5", 1).replace(
        "N", "130.0")}, 12, spans={key: [90.5, 240.31]})
    said = nothing_fits(4, {"tp": 1}, result)
    assert ("no layout of 4 GPUs fits with tp=1: 12 of 12 refused because needs an estimated "
            "90.5-240.3 GiB per GPU, the h200 GPU has 130.0 GiB usable") in said
