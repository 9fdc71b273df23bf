"""`--set section.key=value`: one override of a config key, the same on every command.

`create_config.py` applies them to the config it writes; `train.py` applies them on top of
the config file it reads, so a run can be resumed or varied without editing the file:

    torchrun --nproc_per_node 1 train.py --config tmp/debug/config.json \\
        --set checkpoint.load_path=latest --set training.total_train_steps=400

The value is read as JSON when it parses (`10`, `1e-4`, `true`, `null`, `"8"`), else as a
string (`--set dataset.name=synthetic`); a key that takes only text takes a number or
true/false as written (`--set logging.run_name=2024` names the run "2024"). The result is
validated like any config, so a typo in a key or a value of the wrong type is refused with the
same message as in a file. A key set twice on one command line (two `--set`, or a flag of
create_config.py and a `--set`) takes the last, with a warning that says so.
"""
import json
import typing

from picotron.config.sections import (CheckpointConfig, DatasetConfig, DistributedConfig,
                                      LoggingConfig, ModelConfig, TrainingConfig)
from picotron.errors import ConfigError

# The config's sections and their types (picotron/config/config.py's Config, which imports this
# module, holds one of each).
SECTION_TYPES = {"distributed": DistributedConfig, "model": ModelConfig,
                 "training": TrainingConfig, "dataset": DatasetConfig,
                 "checkpoint": CheckpointConfig, "logging": LoggingConfig}
SECTIONS = tuple(SECTION_TYPES)


def _takes_only_text(section: str, key: str) -> bool:
    """True for a key typed str or Optional[str] (logging.run_name, dataset.subset_name)."""
    if section not in SECTION_TYPES:
        return False
    return typing.get_type_hints(SECTION_TYPES[section]).get(key) in (str, typing.Optional[str])


def parse_override(item: str) -> tuple:
    """'section.key=value' -> (section, key, value)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set {item!r} must look like section.key=value, "
                          f"e.g. --set training.warmup_steps=10")
    path, text = item.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text                   # a bare string: --set dataset.name=synthetic
    # JSON reads `2024` or `true` as a number or a bool, which a text key refuses: the text
    # as typed is what was meant
    if isinstance(value, (int, float)) and _takes_only_text(section, key):
        value = text
    return section, key, value


def apply_overrides(raw: dict, items: list) -> dict:
    """Apply each `--set` item to the config dict `raw` (in place; also returned), in order (a
    key given twice takes the last). An unknown section is refused here; an unknown key or a
    bad value by the config's checks."""
    for item in items:
        section, key, value = parse_override(item)
        if not isinstance(raw.get(section, {}), dict):
            raise ConfigError(f"--set {item!r}: '{section}' in the config is not a section")
        if section not in raw and section not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section '{section}'; valid sections: "
                              f"{', '.join(SECTIONS)}")
        raw.setdefault(section, {})[key] = value
    return raw


def repeated_keys(items: list, set_by_flags: dict = None) -> list:
    """A warning for each key given twice on one command line: by two `--set` items, or by a
    flag and an item (`set_by_flags`: {'section.key': the flag typed, e.g. '--seed 1'}). The
    last is used, as a script that appends an override to its base arguments means; a person
    who typed both learns which one the run takes. Items that do not parse are left to
    apply_overrides to refuse."""
    given, warnings = dict(set_by_flags or {}), []
    for item in items:
        try:
            section, key, _ = parse_override(item)
        except ConfigError:
            continue
        name = f"{section}.{key}"
        if name in given:
            warnings.append(f"'{name}' is given twice, by {given[name]} and by --set {item!r}; "
                            f"the last, --set {item!r}, is used")
        given[name] = f"--set {item!r}"
    return warnings
