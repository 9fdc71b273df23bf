"""Typed run configuration: load from JSON, validate with clear errors, save.

One `Config` of six sections (their keys, defaults and meanings: picotron/config/sections.py).
Every key is a dataclass field, so an unknown key or a value
of the wrong type is refused at load time, as is every number outside its range
(picotron/config/ranges.py) and every impossible layout, before a single process group exists.
`create_config.py` writes through these same types, so what it writes always loads.

A config FILE names all six sections: one left out is an error rather than 200 silent
default steps. An empty section, e.g. `"checkpoint": {}`, takes every default of that section
on purpose (a key left out of a section takes its default). `config_from_dict` builds from
any part of a config, the rest defaulted, for tests and tools.
"""
import copy
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from picotron.config.checks import layout_errors   # the checks live beside, by idea
from picotron.config.features import cuda_graphs_auto_choice, fp8_auto_choice
from picotron.config.ranges import range_errors
from picotron.config.sections import (CheckpointConfig, DatasetConfig, DistributedConfig,
                                      LoggingConfig, ModelConfig, TrainingConfig)  # noqa: F401
from picotron.errors import ConfigError            # noqa: F401 (re-exported)
from picotron.config.overrides import apply_overrides, unknown_name


class MissingPackage(ImportError):
    """The config asks for an optional package (a fast path, a logger) that this machine
    cannot import. Raised when the run is built, before any step; the entry points print it
    without a traceback, as a ConfigError."""

    def __init__(self, option: str, package: str, fallback: str, error: Exception):
        super().__init__(f"{option} needs {package}, which cannot be imported here ({error}); "
                         f"{fallback}")


@dataclass
class Config:
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def world_size(self) -> int:
        d = self.distributed
        return d.dp_size * d.tp_size * d.pp_size * d.cp_size

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, summed over micro-batches and DP replicas."""
        t = self.training
        return t.micro_batch_size * t.gradient_accumulation_steps * self.distributed.dp_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def _type_ok(value, hint) -> bool:
    if typing.get_origin(hint) is typing.Union:          # Optional[X]
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:                                      # JSON writes 1e-4 or 3 alike
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is bool:                # JSON's words, which `--set key=yes` may not know
        return "true or false"
    return "null" if hint is type(None) else hint.__name__


def _build_section(cls, raw, section: str, errors: list):
    if not isinstance(raw, dict):
        errors.append(f"'{section}' must be a JSON object, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:       # the key meant: a common name, or a close spelling
            errors.append(unknown_name(section, key))
        elif not _type_ok(value, hints[key]):
            errors.append(f"'{section}.{key}' must be {_type_name(hints[key])}, "
                          f"got {value!r} ({type(value).__name__})")
        else:
            kwargs[key] = float(value) if hints[key] is float else value
    return cls(**kwargs)


def config_from_dict(raw: dict, world_size: Optional[int] = None,
                     resolve: bool = True) -> Config:
    """Build and validate a Config; raise one ConfigError listing every problem. Its "auto"
    options are resolved (resolve_auto) unless `resolve` is false (create_config.py writes
    them as "auto"); the checks always see them resolved."""
    errors = []
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    built = {}
    for key, value in raw.items():
        if key not in sections:
            errors.append(unknown_name(key, ""))
        else:
            built[key] = _build_section(hints[key], value, key, errors)
    config = Config(**built)
    resolved = copy.deepcopy(config)
    if not errors:
        resolve_auto(resolved)
    # the layout checks divide and compare the sizes: they run once every value is in range
    errors += range_errors(config) or layout_errors(resolved, world_size)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return resolved if resolve else config


# the keys that may name a local file or folder
PATH_KEYS = ("model.name", "dataset.name", "dataset.tokenizer", "dataset.cache_dir",
             "checkpoint.save_dir", "checkpoint.load_path", "checkpoint.init_from",
             "logging.run_dir")


def expand_home(config: Config) -> None:
    """'~/runs/x' where no shell expanded it (`--set logging.run_dir=~/x`: bash expands a
    '~' only at the start of a word; a hand-written config.json) is the home folder's, as
    on the command line, not a folder named '~' in the working directory. Applied by
    load_config, for the process that runs the config; the file keeps the '~'."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(getattr(config, section), name, os.path.expanduser(value))


def resolve_auto(config: Config, fp8_tensor_cores: Optional[bool] = None) -> None:
    """Replace each "auto" speed option by the fastest measured path that fits the layout
    (bench/NOTES.md has the measurements); on CPU, by the readable reference. What was chosen
    is recorded in `config.auto_resolved`, for the run's first line (a second call, finding
    nothing left to choose, keeps that record).

    On a GPU: our Triton kernels with "selective" recomputation (the SwiGLU output recomputed
    inside the MLP: the speed of no recomputation at a fraction of the memory) and the Triton
    fused loss, except that under tensor parallelism the loss is the vocab-parallel one (it
    never gathers the logits either), and that with training.compile the compiler gets the
    readable ops to fuse; CUDA graphs over the layers of one-GPU runs of small models, where
    the host's launches would limit the step (features.cuda_graphs_auto_choice);
    FP8 GEMMs (tensorwise_delayed) for models wide enough that they pay, on GPUs that have FP8
    tensor cores (features.fp8_auto_choice; `fp8_tensor_cores` says whether the GPU has them
    when it is not this process's, as for the config reference; None: ask this process's)."""
    m, t = config.model, config.training
    gpu = not config.distributed.use_cpu
    chosen = {}
    if m.kernels == "auto":
        m.kernels = chosen["model.kernels"] = "triton" if gpu and not t.compile else "torch"
    if t.fused_loss == "auto":
        fits = gpu and config.distributed.tp_size == 1
        t.fused_loss = chosen["training.fused_loss"] = "triton" if fits else "none"
    if t.activation_checkpointing == "auto":
        ours = gpu and m.kernels == "triton"
        t.activation_checkpointing = chosen["training.activation_checkpointing"] = (
            "selective" if ours else "none")
    if t.cuda_graphs == "auto":                      # before FP8, whose choice depends on it
        t.cuda_graphs = chosen["training.cuda_graphs"] = gpu and cuda_graphs_auto_choice(config)
    if t.fp8 == "auto":
        t.fp8 = chosen["training.fp8"] = fp8_auto_choice(config, fp8_tensor_cores) if gpu else "none"
    config.auto_resolved = {**getattr(config, "auto_resolved", {}), **chosen}


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs) -> dict:
    """json's object hook: a hand-edited file that gives a key twice is refused."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def load_config(path: str, world_size: Optional[int] = None, overrides=()) -> Config:
    """The config file at `path`, with `--set section.key=value` overrides applied on top."""
    try:
        with open(path, encoding="utf-8-sig") as f:       # an editor's BOM is not an error
            raw = json.load(f, object_pairs_hook=_unique_keys)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist; write one with "
                          f"`python create_config.py --out_dir tmp --exp_name NAME`") from None
    except OSError as e:              # a folder, or a file this user cannot read
        inside, hint = os.path.join(path, "config.json"), ""
        if os.path.isfile(inside):                  # a run directory: its config
            hint = f"; give {inside}"
        elif os.path.isdir(path):
            hint = "; give a config.json file, not a folder"
        raise ConfigError(f"cannot read config file '{path}': {e.strerror}{hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' is not valid JSON: {e}") from None
    except _DuplicateKey as e:
        raise ConfigError(f"config file '{path}' gives key '{e}' twice in one object; JSON "
                          f"would silently keep the last: delete the one you did not mean"
                          ) from None
    missing = [f.name for f in dataclasses.fields(Config) if isinstance(raw, dict)
               and f.name not in raw]     # an empty section is the opt-in to its defaults
    if missing:
        raise ConfigError(f"config file '{path}' has no {' / '.join(missing)} section; add "
                          f"it, or write `\"{missing[0]}\": {{}}` to take every default of it")
    if overrides and isinstance(raw, dict):
        apply_overrides(raw, list(overrides))
    config = config_from_dict(raw, world_size)
    expand_home(config)             # here, where it runs: the file keeps '~' for any machine
    return config
