"""The config wing: one typed config (a dataclass per section) loaded from JSON, every key
checked by type, range and combination at load time with a message that names the fix, and
`auto` resolved to what runs fastest on this machine. `create_config.py` writes through the
same types, so what it writes always loads.

Reading order (each file needs only the ones before it):
    sections.py   every key of every section, its default and meaning
    ranges.py     the allowed range of every number, where paths point, writable folders
    features.py   what each optional feature (CUDA graphs, FP8, TP overlap, ZeRO-3) cannot be
                  combined with
    checks.py     every reason a layout or a config cannot run, each naming its fix
    overrides.py  `--set section.key=value`, the same on every command; the names a user
                  meant, for an unknown key or flag
    config.py     the typed config: loading, validation, and `resolve_auto` (what `auto` picks)
    presets.py    `--model_name` -> the `model` section (a preset, a local folder, a hub id)
    reference.py  the config reference page (docs/config.md), generated from the above and
                  help.json, one help line a key

The names below are the wing's front door: `from picotron.config import Config, load_config`.
"""
from picotron.config.config import (Config, MissingPackage, config_from_dict,  # noqa: F401
                                     load_config, resolve_auto)
from picotron.config.sections import (DistributedConfig, ModelConfig,  # noqa: F401
                                      TrainingConfig)
from picotron.errors import ConfigError  # noqa: F401
