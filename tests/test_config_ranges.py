"""Every number of the config has a range, checked at load time: a bad value is refused with
one line that names the field, the value, the range and the fix, never a traceback from torch
or a run that trains silently wrong. Also: a config file names all its sections, names point
somewhere, and the run's folders can be written."""
import dataclasses
import json
import os
import typing

import pytest

import train
from launch import write_config
from picotron.config import ranges as config_ranges
from picotron.config import Config, ConfigError, config_from_dict, load_config
from picotron.config.ranges import CHECKED_WITH_THE_LAYOUT, RANGES
from picotron.run.output_paths import check_output_dirs

NAN, INF = float("nan"), float("inf")

BAD = [  # (field, value): each must be refused naming the field
    ("model.hidden_size", 0), ("model.hidden_size", 2 ** 40), ("model.intermediate_size", -1),
    ("model.intermediate_size", 0), ("model.vocab_size", 10 ** 12),
    ("logging.log_frequency", 0), ("logging.log_frequency", -1),
    ("training.learning_rate", NAN), ("training.learning_rate", -1), ("training.learning_rate",
                                                                      INF),
    *[(f"training.adam_beta{i}", v) for i in (1, 2) for v in (NAN, INF, -1, 1.5, 1.0)],
    ("training.adam_eps", NAN), ("training.adam_eps", -1), ("training.adam_eps", INF),
    ("training.adam_eps", 0), ("model.initializer_range", NAN),
    ("model.initializer_range", -1), ("distributed.timeout_s", INF),
    ("distributed.timeout_s", 1e300), ("distributed.timeout_s", 0),
    ("training.seed", 2 ** 70), ("training.seed", -1),
    *[("training.weight_decay", v) for v in (NAN, INF, -1)],
    *[("model.rope_theta", v) for v in (NAN, -1, 0, INF)],
    *[("model.rms_norm_eps", v) for v in (NAN, -1, INF, 0)],
    *[("training.min_lr_ratio", v) for v in (NAN, INF, -1, 2.0)],
    *[("training.max_grad_norm", v) for v in (NAN, INF, -1)],
    ("dataset.num_proc", 0), ("dataset.num_proc", -1),
    ("distributed.bucket_size_mb", NAN), ("distributed.bucket_size_mb", INF),
    ("distributed.bucket_size_mb", 0),
    ("training.initial_loss_scale", NAN), ("training.initial_loss_scale", INF),
    ("training.micro_batch_size", 10 ** 9), ("model.num_hidden_layers", 10 ** 6),
    ("model.max_position_embeddings", 2 ** 40), ("training.total_train_steps", 0),
    ("distributed.dp_size", 0), ("distributed.offload_optim_frac", 1.5),
    ("dataset.num_samples", 0), ("checkpoint.keep_last", -1),
]

GOOD = [  # the ends of the ranges, and values just inside them
    ("training.adam_beta2", 0.0), ("training.adam_beta2", 0.999999), ("training.adam_eps", 1e-30),
    ("training.learning_rate", 0), ("training.learning_rate", 1), ("training.min_lr_ratio", 0),
    ("training.min_lr_ratio", 1), ("training.max_grad_norm", 0), ("training.weight_decay", 0),
    ("distributed.timeout_s", 86400), ("training.seed", 0), ("training.seed", 2 ** 63 - 1),
    ("model.rope_theta", 1.5), ("model.rope_theta", 1e6), ("model.vocab_size", 2 ** 21),
    ("model.hidden_size", 2 ** 17), ("training.initial_loss_scale", 1),
    ("dataset.num_proc", 1024), ("logging.log_frequency", 1), ("dataset.num_samples", None),
    ("distributed.offload_optim_frac", 1.0), ("model.initializer_range", 1.0),
]


def one_field(key: str, value) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_a_value_out_of_range_is_refused_naming_the_field(key, value):
    with pytest.raises(ConfigError) as e:
        config_from_dict(one_field(key, value))
    text = str(e.value)
    line = next((x for x in text.splitlines() if f"{key}=" in x), None)
    assert line is not None, text
    if key in RANGES:             # the value, the allowed range and the default as the fix
        assert repr(value) in line and f"set it in {RANGES[key][0]}" in line, line


@pytest.mark.parametrize("key,value", GOOD, ids=[f"{k}={v}" for k, v in GOOD])
def test_a_value_at_the_edge_of_its_range_is_accepted(key, value):
    config = config_from_dict(one_field(key, value))
    section, name = key.split(".")
    assert getattr(getattr(config, section), name) == value


def test_every_number_of_every_section_has_a_range():
    numbers, defaults = set(), Config()
    for section in dataclasses.fields(Config):
        for name, hint in typing.get_type_hints(section.type).items():
            if int in (hint, *typing.get_args(hint)) or float in (hint, *typing.get_args(hint)):
                numbers.add(f"{section.name}.{name}")
    assert numbers == set(RANGES) | set(CHECKED_WITH_THE_LAYOUT)
    for key, (allowed, _) in RANGES.items():      # and every default lies in its range
        section, name = key.split(".")
        value = getattr(getattr(defaults, section), name)
        assert value is None or allowed.problem(value) is None, (key, value)


def test_range_bounds_read_as_written():
    assert str(RANGES["training.adam_beta1"][0]) == "[0, 1)"
    assert str(RANGES["training.seed"][0]) == "[0, 2^63)"
    assert RANGES["model.rms_norm_eps"][0].problem(0) == "must be > 0"
    assert RANGES["training.adam_beta2"][0].problem(1.0) == "must be < 1"
    assert RANGES["training.learning_rate"][0].problem(NAN) == "is not a number"


def test_range_errors_come_before_the_layout_checks():
    """The layout checks would divide by num_attention_heads=0: only the ranges are named."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"hidden_size": 0, "num_attention_heads": 0}})
    assert "model.hidden_size=0 must be >= 2" in str(e.value)
    assert "model.num_attention_heads=0 must be >= 1" in str(e.value)
    assert "divisible" not in str(e.value)


def test_a_config_file_names_every_section(tmp_path):
    raw = Config().to_dict()
    del raw["training"], raw["logging"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="has no training / logging section"):
        load_config(str(path))
    raw["training"], raw["logging"] = {}, {"log_frequency": 3}     # {}: every default
    path.write_text(json.dumps(raw))
    config = load_config(str(path))
    defaults = config_from_dict({})                        # "auto" resolved the same way
    assert config.training == defaults.training and config.logging.log_frequency == 3
    assert config_from_dict({"model": {"hidden_size": 64}}).training == defaults.training


def test_a_config_path_that_is_no_json_file_is_refused(tmp_path):
    (tmp_path / "binary.json").write_bytes(b"\xd0\xff{")
    for path, words in ((tmp_path, "cannot read config file"),
                        (tmp_path / "binary.json", "is not valid JSON"),
                        (tmp_path / "missing.json", "does not exist")):
        with pytest.raises(ConfigError, match=words):
            load_config(str(path))


def test_a_key_given_twice_is_refused_and_a_bom_is_read(tmp_path):
    """json.load keeps the last of two equal keys: a hand edit that added one above the
    other would train with the old value, silently."""
    path = tmp_path / "config.json"
    text = json.dumps(Config().to_dict(), indent=2)
    path.write_text(text.replace('"training": {', '"training": {"learning_rate": 0.1,', 1))
    with pytest.raises(ConfigError, match="gives key 'learning_rate' twice in one object"):
        load_config(str(path))
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())       # saved by an editor with a BOM
    assert load_config(str(path)).training == config_from_dict(Config().to_dict()).training


def test_tokenizer_and_weights_must_point_somewhere(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (tmp_path / "file.json").write_text("{}")
    synthetic = {"name": "synthetic"}
    for tokenizer in ("byte", str(folder), "gpt2", "HuggingFaceTB/SmolLM-135M"):
        config_from_dict({"dataset": {**synthetic, "tokenizer": tokenizer}})
    for tokenizer, words in ((str(tmp_path / "missing"), "nothing exists there"),
                             ("./no/such/dir", "nothing exists there"),
                             ("../up", "nothing exists there"),
                             (str(tmp_path / "file.json"), "is a file")):
        with pytest.raises(ConfigError, match=words):
            config_from_dict({"dataset": {**synthetic, "tokenizer": tokenizer}})
    with pytest.raises(ConfigError, match="dataset.tokenizer='gpt2' would be ignored"):
        config_from_dict({"dataset": {"name": "embedded", "tokenizer": "gpt2"}})
    for key in ("name", "split", "text_column"):
        with pytest.raises(ConfigError, match=f"dataset.{key}=' ' is empty"):
            config_from_dict({"dataset": {key: " "}})
    with pytest.raises(ConfigError, match="checkpoint.init_from='/no/such/weights'"):
        config_from_dict({"checkpoint": {"init_from": "/no/such/weights"}})


def test_output_folders_must_be_writable(tmp_path, monkeypatch):
    config = config_from_dict({"checkpoint": {"save_frequency": 5}})
    check_output_dirs(config, str(tmp_path / "new" / "run"))      # created later: fine
    (tmp_path / "blocker").write_text("")
    with pytest.raises(ConfigError, match="blocker' .* is not a folder"):
        check_output_dirs(config, str(tmp_path / "blocker" / "run"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")
    with pytest.raises(ConfigError, match="checkpoint.save_dir .*checkpoints' is not a folder"):
        check_output_dirs(config, str(run))
    quiet = config_from_dict({"checkpoint": {"save_frequency": 0, "save_final": False}})
    check_output_dirs(quiet, str(run))                # no checkpoint: save_dir is never used
    (run / "cache").write_text("")                    # a token cache folder that is a file
    cached = config_from_dict({"checkpoint": {"save_final": False},
                               "dataset": {"name": "org/data", "cache_dir": "cache"}})
    with pytest.raises(ConfigError, match="dataset.cache_dir .*cache' is not a folder"):
        check_output_dirs(cached, str(run))
    check_output_dirs(config_from_dict({"checkpoint": {"save_final": False},   # not tokenized
                                        "dataset": {"cache_dir": "cache"}}), str(run))
    (tmp_path / "xdg").write_text("")                 # the default cache, behind a file
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default_cache = config_from_dict({"checkpoint": {"save_final": False},
                                      "dataset": {"name": "org/data"}})
    with pytest.raises(ConfigError, match="the token cache .*null.*xdg' .* is not a folder"):
        check_output_dirs(default_cache, str(run))
    monkeypatch.delenv("XDG_CACHE_HOME")
    # root may write anywhere, so a folder without write permission is played by os.access
    real = os.access
    monkeypatch.setattr(config_ranges.os, "access",
                        lambda p, mode: False if p == str(tmp_path) else real(p, mode))
    with pytest.raises(ConfigError, match="is not writable by this user"):
        check_output_dirs(quiet, str(tmp_path / "fresh"))


def test_the_files_a_run_writes_must_not_be_folders(tmp_path):
    """metrics.jsonl, launches.jsonl and the checkpoints' `latest`: a folder by one of these
    names would stop the run at its first record or save (a resume would ignore `latest`)."""
    run = tmp_path / "run"
    for name in ("metrics.jsonl", "launches.jsonl", "checkpoints/latest"):
        (run / name).mkdir(parents=True)
    with pytest.raises(ConfigError) as refused:
        check_output_dirs(config_from_dict({"checkpoint": {"save_frequency": 5}}), str(run))
    for name in ("metrics.jsonl", "launches.jsonl", "latest"):
        assert f"{name}' is a folder where the run writes a file" in str(refused.value)
    assert "checkpoints beside it are not touched" in str(refused.value)
    (run / "tensorboard").write_text("")
    with pytest.raises(ConfigError, match="logging.tensorboard's folder .*not a folder"):
        check_output_dirs(config_from_dict({"logging": {"tensorboard": True}}), str(run))


def test_train_refuses_a_run_dir_behind_a_file_before_building(tmp_path):
    path = write_config(tmp_path, "shadow", ["--dataset_name", "synthetic",
                                             "--set", f"logging.run_dir={tmp_path}/f/run"])
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="the run directory"):
        train.main(["--config", path])


def test_a_run_dir_that_permissions_allow_but_cannot_be_made_is_refused(tmp_path):
    """/proc looks writable to root (os.access says yes), but nothing can be made in it: the
    run directory is made at the check, so the run stops there, not at its first record."""
    for run_dir in (tmp_path / "made" / "here", "/proc/picotron_run"):
        config = config_from_dict({})
        try:
            check_output_dirs(config, str(run_dir))
        except ConfigError as e:
            assert str(run_dir) == "/proc/picotron_run" and "choose another folder" in str(e)
        else:
            assert os.path.isdir(run_dir), run_dir
