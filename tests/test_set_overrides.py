"""`--set section.key=value` on the command line (picotron/overrides.py): a key given twice is
refused, not silently taken from the last; a text key takes a number or true/false as the
text typed."""
import json

import pytest

from launch import write_config
from picotron.config import ConfigError, load_config

BASE = ["--dataset_name", "synthetic", "--skip_local_checks"]

TWICE = [  # (command-line flags, the two spellings the message names)
    (["--seed", "1", "--set", "training.seed=2"], ["--seed 1", "--set 'training.seed=2'"]),
    (["--mbs", "4", "--set", "training.micro_batch_size=8"],
     ["--mbs 4", "--set 'training.micro_batch_size=8'"]),
    (["--set", "training.seed=1", "--set", "training.seed=2"],
     ["--set 'training.seed=1'", "--set 'training.seed=2'"]),
    (["--set", "distributed.use_cpu=false"], ["--use_cpu", "--set 'distributed.use_cpu=false'"]),
]


@pytest.mark.parametrize("flags,spellings", TWICE)
def test_create_config_refuses_a_key_given_twice(tmp_path, capsys, flags, spellings):
    with pytest.raises(SystemExit) as stopped:
        write_config(tmp_path, "twice", BASE + flags)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    name = spellings[1].split("'")[1].split("=")[0]
    assert f"'{name}' is given twice, by {spellings[0]} and by {spellings[1]}" in err, err
    assert "keep one of them" in err
    assert not (tmp_path / "twice").exists()


def test_a_flag_left_at_its_default_does_not_count(tmp_path):
    """Flags have defaults; only one typed on the command line sets its key."""
    path = write_config(tmp_path, "once", BASE + ["--set", "training.seed=5", "--set",
                                                  "training.micro_batch_size=3"])
    with open(path) as f:
        training = json.load(f)["training"]
    assert (training["seed"], training["micro_batch_size"]) == (5, 3)


def test_train_refuses_two_sets_of_one_key(tmp_path):
    path = write_config(tmp_path, "run", BASE)
    with pytest.raises(ConfigError, match=r"'training.seed' is given twice, by --set "
                                          r"'training.seed=1' and by --set 'training.seed=2'"):
        load_config(path, overrides=["training.seed=1", "training.seed=2"])
    load_config(path, overrides=["training.seed=1", "training.warmup_steps=2"])


@pytest.mark.parametrize("typed,text", [("2024", "2024"), ("1e3", "1e3"), ("true", "true"),
                                        ('"2024"', "2024"), ("run-7", "run-7")])
def test_a_text_key_takes_a_number_as_typed(tmp_path, typed, text):
    path = write_config(tmp_path, "named", BASE + ["--set", f"logging.run_name={typed}",
                                                   "--set", f"dataset.subset_name={typed}"])
    with open(path) as f:
        saved = json.load(f)
    assert saved["logging"]["run_name"] == text and saved["dataset"]["subset_name"] == text
    config = load_config(path, overrides=[f"logging.run_name={typed}"])
    assert config.logging.run_name == text
    assert load_config(path, overrides=["logging.run_name=null"]).logging.run_name is None


def test_other_keys_still_read_json(tmp_path):
    """Numbers stay numbers where the key takes one (cuda_graphs takes true/false or a word),
    and a quoted number for a number key is still refused."""
    path = write_config(tmp_path, "typed", BASE)
    config = load_config(path, overrides=["training.seed=7", "training.cuda_graphs=false"])
    assert config.training.seed == 7 and config.training.cuda_graphs is False
    with pytest.raises(ConfigError, match="'training.seed' must be int"):
        load_config(path, overrides=['training.seed="7"'])
