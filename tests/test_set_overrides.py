"""`--set section.key=value` on the command line (picotron/overrides.py): a key given twice is
refused, not silently taken from the last."""
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
