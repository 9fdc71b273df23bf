"""A hardware profile of one's own machines: a profile's JSON file passed by its path to
--hardware (picotron/plan/hardware.py's load_profile) is read as the shipped ones are, its
numbers reach the prediction, and a file that is not a profile ends in one line that says
what is wrong in it. CPU only: the model is arithmetic."""
import json
import os

import pytest

from picotron.plan.__main__ import main
from picotron.plan.hardware import HERE, load_profile
from picotron.plan.layouts import config_for
from picotron.plan.step_time import predict

SEARCH = ["search", "--model_name", "debug", "--gpus", "16", "--seq_len", "64",
          "--global_batch_tokens", "4096", "--top", "1"]
# dp 16 across two nodes of 8: its gradients' reduction crosses the link between them
ROW = dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=256, tied=0, seq=64,
           gpus=16, gpus_per_node=8, dp=16, tp=1, pp=1, cp=1, zero=0, mbs=1, grad_acc=1)


def shipped(name="playbook-h100") -> dict:
    with open(os.path.join(HERE, f"{name}.json")) as f:
        return json.load(f)


def write(tmp_path, data, name="my-cluster.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_profile_file_of_ones_own_is_read_and_its_numbers_reach_the_prediction(tmp_path,
                                                                                capsys):
    data = shipped()
    data["numbers"]["inter_bytes_per_s"]["value"] /= 8          # a slower link between nodes
    data["numbers"]["inter_bytes_per_s"]["source"] = "assumed: an eighth of the Playbook's"
    mine = load_profile(write(tmp_path, data))
    assert mine.name == "my-cluster" and mine.traits == load_profile("playbook-h100").traits
    config = config_for(ROW)
    slow, quick = predict(config, mine, 8), predict(config, load_profile("playbook-h100"), 8)
    assert slow.step_s > quick.step_s and slow.parts["dp"] > quick.parts["dp"]
    main(SEARCH + ["--hardware", write(tmp_path, data)])
    assert "(8 per node, profile my-cluster)" in capsys.readouterr().out


def broken(change):
    data = shipped("h200")
    change(data)
    return data


@pytest.mark.parametrize("data, words", [
    ("{not json", "is not JSON"),
    ([1, 2], 'no "numbers" object'),
    (broken(lambda d: d["numbers"].pop("gemm_eff")), "missing numbers gemm_eff"),
    (broken(lambda d: d["numbers"].update(gemm_efff=d["numbers"].pop("gemm_eff"))),
     "unknown numbers gemm_efff (the numbers are: memory_gib"),
    (broken(lambda d: d["numbers"]["launch_s"].update(value="fast")),
     'launch_s needs a "value" that is a number'),
    (broken(lambda d: d["numbers"]["launch_s"].pop("source")), 'launch_s has no "source"'),
    (broken(lambda d: d["traits"].update(pp_splt="compute")), "unknown traits pp_splt"),
])
def test_a_file_that_is_not_a_profile_ends_in_one_line_naming_what_is_wrong(tmp_path, capsys,
                                                                           data, words):
    path = write(tmp_path, data)
    with pytest.raises(SystemExit) as stop:
        main(SEARCH + ["--hardware", path])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: hardware profile {path}") and words in err, err


def test_a_profile_path_that_is_not_there_names_the_known_profiles(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(SEARCH + ["--hardware", str(tmp_path / "nowhere.json")])
    err = capsys.readouterr().err.strip()
    assert "no hardware profile file" in err and "h200, playbook-h100" in err
