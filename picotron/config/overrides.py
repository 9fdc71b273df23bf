"""`--set section.key=value`: one override of a config key, the same on every command.

`create_config.py` applies them to the config it writes; `train.py` applies them on top of
the config file it reads, so a run can be resumed or varied without editing the file:

    torchrun --nproc_per_node 1 train.py --config tmp/debug/config.json \\
        --set checkpoint.load_path=latest --set training.total_train_steps=400

The value is read as JSON when it parses (`10`, `1e-4`, `true`, `null`, `"8"`), else as a
string (`--set dataset.name=synthetic`); a key that takes only text takes a number or
true/false as written (`--set logging.run_name=2024` names the run "2024"). The result is
validated like any config, so a value of the wrong type is refused with the same message as in
a file. A key set twice on one command line (two `--set`, or a flag of create_config.py and a
`--set`) takes the last, with a warning that says so.

A name that is not one of ours is refused with the names it most likely meant: the one it
stands for when it is another trainer's name (`lr` for `learning_rate`), else those it
abbreviates, else the closest spellings (difflib). That holds for a key of `--set`, and for a
flag of the commands a user runs, which parse theirs with `parse_flags`. Every parser of the
repository is built with `allow_abbrev=False`: argparse would take `--seq` for `--seq_len`, and
a flag added later could make such a command ambiguous, or change what it sets.
"""
import difflib
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


def by_alias(table: dict) -> dict:
    """{name: (its common names)} -> {common name: name}: the tables below read by name."""
    return {alias: name for name, aliases in table.items() for alias in aliases}


# Common names of a key (other trainers', papers'), by the key they mean.
KEY_ALIASES = by_alias({
    "training.learning_rate": ("lr", "max_lr", "peak_lr"),
    "training.total_train_steps": ("steps", "max_steps", "train_steps", "num_steps", "max_iters"),
    "training.micro_batch_size": ("batch_size", "micro_batch", "mbs", "micro_bsz"),
    "training.gradient_accumulation_steps": ("grad_acc_steps", "grad_accum", "accumulate"),
    "training.seq_length": ("seq_len", "seq", "max_seq_len", "block_size", "context_length"),
    "training.warmup_steps": ("warmup", "warmup_iters"),
    "training.max_grad_norm": ("grad_clip", "clip_grad_norm", "clip_grad", "gradient_clipping"),
    "training.weight_decay": ("wd",),
    "training.adam_beta1": ("beta1",), "training.adam_beta2": ("beta2",),
    "training.adam_eps": ("eps", "epsilon"),
    "training.dtype": ("precision", "mixed_precision"),
    "training.val_frequency": ("eval_every", "eval_interval", "val_every", "val_interval"),
    "distributed.dp_size": ("dp",), "distributed.tp_size": ("tp",),
    "distributed.pp_size": ("pp",), "distributed.cp_size": ("cp",),
    "distributed.zero_stage": ("zero",),
    "model.num_hidden_layers": ("n_layer", "n_layers", "num_layers", "layers"),
    "model.num_attention_heads": ("n_head", "n_heads", "num_heads", "heads"),
    "model.num_key_value_heads": ("n_kv_heads", "num_kv_heads", "kv_heads"),
    "model.hidden_size": ("n_embd", "d_model", "dim", "hidden_dim"),
    "model.intermediate_size": ("ffn_dim", "d_ff", "mlp_dim"),
    "model.name": ("model_name",), "dataset.name": ("dataset_name",),
    "checkpoint.save_frequency": ("save_every", "save_interval", "save_steps"),
    "checkpoint.load_path": ("resume", "resume_from"),
    "logging.log_frequency": ("log_every", "log_interval"),
    "logging.use_wandb": ("wandb",),
})
SECTION_ALIASES = by_alias({
    "training": ("optim", "optimizer", "trainer"), "distributed": ("parallel", "parallelism"),
    "checkpoint": ("ckpt", "checkpointing"), "dataset": ("data",), "logging": ("log",),
})


def nearest(name: str, known: list, aliases: dict) -> list:
    """The names of `known` that a mistyped `name` most likely meant: the one its common name
    stands for; else those it abbreviates; else difflib's closest spellings (at most 3). The
    first answer found is the only one given: `--seq` means `--seq_len`, not also `--set`."""
    if aliases.get(name) in known:
        return [aliases[name]]
    abbreviated = [k for k in known if name and k.startswith(name)]
    return abbreviated[:3] or difflib.get_close_matches(name, known, n=3)


def keys_of(section: str) -> list:
    return list(typing.get_type_hints(SECTION_TYPES[section]))


def paths_of(key: str) -> list:
    """'section.key' of the key this is a common name of, and of each section that has a key
    of this name (`name`: model.name and dataset.name)."""
    return ([KEY_ALIASES[key]] if key in KEY_ALIASES else []) + [
        f"{section}.{key}" for section in SECTIONS if key in keys_of(section)]


def unknown_name(section: str, key: str):
    """What is wrong with `section.key` when it is not a key of the config, naming what it most
    likely meant (None when it is one). The section's keys are listed only when none is near."""
    if section not in SECTIONS:
        near = paths_of(key) or nearest(section, list(SECTIONS), SECTION_ALIASES)
        listed = f"valid sections: {', '.join(SECTIONS)}"
        return f"unknown section '{section}'; " + (f"did you mean {' or '.join(near)}?"
                                                   if near else listed)
    if key in keys_of(section):
        return None
    # a common name, or a key of another section; else a spelling of one of this section's
    near = paths_of(key) or [f"{section}.{k}" for k in nearest(key, keys_of(section), {})]
    listed = f"{section}'s keys: {', '.join(keys_of(section))}"
    return f"unknown key '{section}.{key}'; " + (f"did you mean {' or '.join(near)}?"
                                                 if near else listed)


def _takes_only_text(section: str, key: str) -> bool:
    """True for a key typed str or Optional[str] (logging.run_name, dataset.subset_name)."""
    if section not in SECTION_TYPES:
        return False
    return typing.get_type_hints(SECTION_TYPES[section]).get(key) in (str, typing.Optional[str])


def parse_override(item: str) -> tuple:
    """'section.key=value' -> (section, key, value)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        name, _, text = item.partition("=")        # a key without its section: show where
        example = f"{paths_of(name)[0]}={text or '...'}" if paths_of(name) else (
            "training.warmup_steps=10")
        raise ConfigError(f"--set {item!r} must look like section.key=value, "
                          f"e.g. --set {example}")
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
    key given twice takes the last). An unknown section or key is refused here, every one at
    once, each with the names it most likely meant; a bad value by the config's checks."""
    problems = []
    for item in items:
        section, key, value = parse_override(item)
        if not isinstance(raw.get(section, {}), dict):
            raise ConfigError(f"--set {item!r}: '{section}' in the config is not a section")
        if unknown_name(section, key):
            problems.append(f"--set {item!r}: {unknown_name(section, key)}")
        raw.setdefault(section, {})[key] = value
    if problems:
        raise ConfigError("\n".join(problems))
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


# Common names of a flag, by the flag of ours they mean (create_config.py keeps picotron's
# spelling); one a script lacks is never suggested there.
FLAG_ALIASES = by_alias({
    "seq_len": ("seq_length", "seq", "max_seq_len", "block_size", "context_length"),
    "learning_rate": ("lr", "max_lr"),
    "total_train_steps": ("steps", "max_steps", "train_steps", "num_steps", "max_iters"),
    "mbs": ("batch_size", "micro_batch_size", "micro_batch", "per_device_train_batch_size"),
    "grad_acc_steps": ("gradient_accumulation_steps", "grad_accum", "grad_accum_steps"),
    "dp": ("dp_size",), "tp": ("tp_size",), "pp": ("pp_size",), "cp": ("cp_size",),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers", "layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads", "heads"),
    "num_key_value_heads": ("n_kv_heads", "num_kv_heads", "kv_heads"),
    "exp_name": ("name", "run_name"), "out_dir": ("output_dir",),
    "model_name": ("model",), "dataset_name": ("dataset", "data"), "use_cpu": ("cpu",),
    "use_wandb": ("wandb",), "zero_stage": ("zero",), "checkpoint": ("ckpt",),
    "config": ("cfg",), "max_new_tokens": ("max_tokens", "num_tokens", "max_length"),
})


def flag_suggestions(parser, flag: str, value: str) -> list:
    """The flags of `parser` that `flag` most likely meant. On a script with `--set`, a config
    key's name (or common name) that no flag of the script stands for means `--set` of it."""
    flags = [s[2:] for action in parser._actions for s in action.option_strings
             if s.startswith("--")]
    name = flag.lstrip("-")
    if "set" in flags and FLAG_ALIASES.get(name) not in flags and paths_of(name):
        return [f"--set {path}={value or '...'}" for path in paths_of(name)]
    return [f"--{f}" for f in nearest(name, flags, FLAG_ALIASES)]


def unknown_flags_message(parser, extras: list) -> str:
    """One line for argparse's leftovers: each unknown flag with what it most likely meant."""
    parts, unmatched = [], False
    for i, token in enumerate(extras):
        if not token.startswith("-") or is_number(token):
            continue                                     # a value (-1 included), not a flag
        flag, _, value = token.partition("=")
        if not value and i + 1 < len(extras) and not extras[i + 1].startswith("-"):
            value = extras[i + 1]                        # `--lr 1e-3`: its value follows
        near = flag_suggestions(parser, flag, value)
        parts.append(f"{flag} (did you mean {' or '.join(near)}?)" if near else flag)
        unmatched = unmatched or not near
    if not parts:                     # only stray values: argparse's own words
        return f"unrecognized arguments: {' '.join(extras)}"
    return (f"unknown flag{'s' if len(parts) > 1 else ''} {', '.join(parts)}"
            + ("; --help lists every flag" if unmatched else ""))


def is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def one_line_error(parser, message: str):
    """argparse's refusal (exit code 2) in one line, without the usage block before it: the
    line that says what is wrong is the one a user must not miss."""
    hint = "" if "--help" in message else "; --help lists every flag"
    parser.exit(2, f"{parser.prog}: error: {message}{hint}\n")


def parse_flags(parser, argv=None):
    """`parser.parse_args(argv)`, but an unknown flag is refused with the flags it most likely
    meant, and every refusal is one line (`one_line_error`, exit code 2). The parser is built with
    `allow_abbrev=False`, so an abbreviation is unknown too, and answered the same way.
    Unknown flags are looked for first, with no argument required: `--conf x` would
    otherwise be refused as a missing `--config`, its real cause unsaid."""
    parser.error = lambda message: one_line_error(parser, message)
    required = [action for action in parser._actions if action.required]
    for action in required:
        action.required = False
    try:
        _, extras = parser.parse_known_args(argv)
    finally:
        for action in required:
            action.required = True
    if extras:
        parser.error(unknown_flags_message(parser, extras))
    return parser.parse_args(argv)
