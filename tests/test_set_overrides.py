"""`--set section.key=value` on the command line (picotron/config/overrides.py): a key given twice
takes the last, with a warning naming both spellings (scripts append overrides to a base list;
a person who typed both learns which one is used); a text key takes a number or true/false as
the text typed; an unknown key or section is refused naming the key meant (another trainer's
name for it, a spelling close to it), and the section's keys only when none is near."""
import json

import pytest
import torch

from launch import write_config
from tiny import one_process_group
from picotron.config import Config, ConfigError, config_from_dict, load_config
from picotron.config.overrides import KEY_ALIASES, repeated_keys
from picotron.run.report import describe_run

BASE = ["--dataset_name", "synthetic", "--skip_local_checks"]

TWICE = [  # (command-line flags, the two spellings the warning names, the key's value written)
    (["--seed", "1", "--set", "training.seed=2"], ["--seed 1", "--set 'training.seed=2'"],
     ("training", "seed", 2)),
    (["--mbs", "4", "--set", "training.micro_batch_size=8"],
     ["--mbs 4", "--set 'training.micro_batch_size=8'"], ("training", "micro_batch_size", 8)),
    (["--set", "training.seed=1", "--set", "training.seed=2"],
     ["--set 'training.seed=1'", "--set 'training.seed=2'"], ("training", "seed", 2)),
    (["--set", "distributed.use_cpu=true"], ["--use_cpu", "--set 'distributed.use_cpu=true'"],
     ("distributed", "use_cpu", True)),
]


@pytest.mark.parametrize("flags,spellings,written", TWICE)
def test_create_config_takes_the_last_of_a_key_given_twice_and_says_so(tmp_path, capsys, flags,
                                                                       spellings, written):
    path = write_config(tmp_path, "twice", BASE + flags)
    err = capsys.readouterr().err
    name = spellings[1].split("'")[1].split("=")[0]
    assert (f"warning: '{name}' is given twice, by {spellings[0]} and by {spellings[1]}; the "
            f"last, {spellings[1]}, is used") in err, err
    section, key, value = written
    with open(path) as f:
        assert json.load(f)[section][key] == value


def test_a_flag_left_at_its_default_does_not_count(tmp_path, capsys):
    """Flags have defaults; only one typed on the command line sets its key."""
    path = write_config(tmp_path, "once", BASE + ["--set", "training.seed=5", "--set",
                                                  "training.micro_batch_size=3"])
    assert "given twice" not in capsys.readouterr().err
    with open(path) as f:
        training = json.load(f)["training"]
    assert (training["seed"], training["micro_batch_size"]) == (5, 3)


def test_train_takes_the_last_of_two_sets_and_says_so_in_its_first_lines(tmp_path):
    path = write_config(tmp_path, "run", BASE)
    twice = ["training.seed=1", "training.seed=2"]
    config = load_config(path, overrides=twice)
    assert config.training.seed == 2
    lines = describe_run(config, one_process_group(), torch.device("cpu"), str(tmp_path), twice)
    assert ("warning: 'training.seed' is given twice, by --set 'training.seed=1' and by --set "
            "'training.seed=2'; the last, --set 'training.seed=2', is used") in lines
    assert repeated_keys(["training.seed=1", "training.warmup_steps=2"]) == []


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


MEANT = [  # (--set item, the key meant): a common name, a typo, a key of another section
    ("training.lr=1e-3", "training.learning_rate"),
    ("training.steps=9", "training.total_train_steps"),
    ("training.max_steps=9", "training.total_train_steps"),
    ("training.batch_size=4", "training.micro_batch_size"),
    ("training.micro_batch=4", "training.micro_batch_size"),
    ("training.seq_len=64", "training.seq_length"),
    ("training.max_seq_len=64", "training.seq_length"),
    ("training.warmup=5", "training.warmup_steps"),
    ("training.grad_clip=1", "training.max_grad_norm"),
    ("training.clip_grad_norm=1", "training.max_grad_norm"),
    ("training.wd=0", "training.weight_decay"),
    ("training.learnin_rate=1", "training.learning_rate"),
    ("training.dp_size=2", "distributed.dp_size"),
    ("model.n_layer=2", "model.num_hidden_layers"),
]
SECTION_MEANT = [  # (--set item of an unknown section, what is meant)
    ("train.lr=1e-3", "training.learning_rate"),
    ("optim.weight_decay=0", "training.weight_decay"),
    ("trainin.seed=1", "training.seed"),
    ("ckpt.save_frequency=5", "checkpoint.save_frequency"),
]


@pytest.mark.parametrize("item,meant", MEANT + SECTION_MEANT)
def test_an_unknown_key_names_the_key_meant(tmp_path, item, meant):
    """Named, without the section's 27 keys; on train.py's path (load_config)."""
    path = write_config(tmp_path, "run", BASE)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides=[item])
    path_typed = item.split("=")[0]
    unknown = (f"key '{path_typed}'" if (item, meant) in MEANT
               else f"section '{path_typed.split('.')[0]}'")
    assert str(e.value) == f"--set {item!r}: unknown {unknown}; did you mean {meant}?"


def test_create_config_says_the_key_meant_on_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        write_config(tmp_path, "lr", BASE + ["--set", "training.lr=1e-3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: --set 'training.lr=1e-3': unknown key "
                                       "'training.lr'; did you mean training.learning_rate?\n")


def test_the_keys_are_listed_only_when_none_is_near(tmp_path):
    path = write_config(tmp_path, "run", BASE)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides=["training.zzz=1", "nowhere.zzz=1", "training.lr=1"])
    training = ", ".join(Config().to_dict()["training"])
    assert str(e.value).splitlines() == [
        f"--set 'training.zzz=1': unknown key 'training.zzz'; training's keys: {training}",
        "--set 'nowhere.zzz=1': unknown section 'nowhere'; valid sections: distributed, model, "
        "training, dataset, checkpoint, logging",
        "--set 'training.lr=1': unknown key 'training.lr'; did you mean training.learning_rate?"]


def test_a_key_without_its_section_is_shown_with_it(tmp_path):
    path = write_config(tmp_path, "run", BASE)
    with pytest.raises(ConfigError, match=r"section.key=value, e.g. --set "
                                          r"training.learning_rate=1e-3$"):
        load_config(path, overrides=["lr=1e-3"])


def test_every_common_name_stands_for_a_key():
    """The table of other trainers' key names names keys that the config has."""
    keys = {f"{section}.{key}" for section, fields in Config().to_dict().items()
            for key in fields}
    assert not set(KEY_ALIASES.values()) - keys


def test_a_config_files_unknown_keys_name_the_keys_meant():
    """A config file is read as --set is: a common name or a misspelling names the key meant."""
    raw = Config().to_dict()
    raw["training"]["lr"], raw["model"]["hiden_size"], raw["trainin"] = 1e-3, 64, {}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    for said in ("unknown key 'training.lr'; did you mean training.learning_rate?",
                 "unknown key 'model.hiden_size'; did you mean model.hidden_size?",
                 "unknown section 'trainin'; did you mean training?"):
        assert said in str(e.value), str(e.value)
