"""Is this checkpoint whole? Its state.json, checked field by field, and every file it lists.

A checkpoint directory `step_NNNNNN/` is trusted only as a whole:
- `state.json` carries `state_sha256`, the sha256 of its own canonical content (every other
  key, sorted, compact JSON), so an edit or a damaged byte anywhere in it, the manifest
  included, is caught; each field is then checked for its type and range, and for agreeing
  with the others (the step with the directory's name, the data position and the tokens seen
  with the step);
- its manifest `sha256` {file name: sha256} lists every other file: weights and optimizer
  shards and every rank's RNG state. A file it lists that is missing or differs, a file it
  does not list, or a shard the saved layout must have written but the manifest lacks, is
  refused by name. Nothing in a checkpoint is a pickle: no file is ever unpickled.

`directory_problems` hashes one share of the files (`rank::world`), so every rank of a
resume hashes a part and the ranks agree on the union (picotron/checkpoint/checkpoint.py).
"""
import hashlib
import json
import os
import re

from picotron.config import Config
from picotron.checkpoint.shards import CheckpointError
from picotron.utils import SCHEDULE_SETTINGS, sha256

FORMAT_VERSION = 2      # 2: RNG states in safetensors, a self-checksum, the accepted changes
STATE_FILE = "state.json"


def step_names(save_root: str) -> list:
    """The step_N directory names under save_root, by step (as numbers: step_1000000 comes
    after step_999999, which a sort of the names would not give)."""
    if not os.path.isdir(save_root):
        return []
    names = [d for d in os.listdir(save_root) if d.startswith("step_") and d[5:].isdigit()]
    return sorted(names, key=lambda d: int(d[5:]))


def latest_written(save_root: str):
    """The step directory name that save_root's `latest` file names (the last checkpoint
    written, which after a resume from an older one is not the highest step), or None."""
    try:
        with open(os.path.join(save_root, "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None
NULL = type(None)
# The saved config's settings that the checks below and a resume compare
# (picotron/checkpoint/changes.py), with their JSON types. They are read one by one, not
# validated as a whole config: a check of this machine (a local folder that must exist) must
# not refuse a checkpoint that was moved to another one.
SAVED_SETTINGS = {
    **{f"distributed.{k}_size": int for k in ("dp", "pp", "cp", "tp")},
    **{f"training.{k}": int for k in ("micro_batch_size", "gradient_accumulation_steps",
                                      "seq_length", "seed")},
    "dataset.name": str, "dataset.subset_name": (str, NULL), "dataset.split": str,
    "dataset.text_column": str, "dataset.tokenizer": (str, NULL),
    "dataset.num_samples": (int, NULL), "dataset.val_split": (str, NULL),
    "dataset.val_samples": int, "dataset.byte_range": (list, NULL),
    "dataset.val_byte_range": (list, NULL),
    **{f"model.{k}": int for k in ("vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads")},
    "model.tie_word_embeddings": bool, "model.parallel_residual": bool, "model.norm_type": str,
}
# Model settings that change what the weights compute but not their shapes. Read when present
# (null when a checkpoint lacks one), so a checkpoint written before they were compared
# still resumes.
FUNCTION_SETTINGS = {"model.rope_theta": (int, float), "model.rms_norm_eps": (int, float)}
# The learning-rate schedule's settings (picotron/utils.py's lr_at), read the same way: a
# resume says how this config's schedule differs from the one the checkpoint trained under.
SCHEDULE_FIELDS = {f"training.{k}": int if k.endswith("_steps") else (int, float)
                   for k in SCHEDULE_SETTINGS}
# The precision the run trained in, read the same way: a resume in another one is recorded.
PRECISION_FIELDS = {"training.dtype": str, "training.master_weights": bool}


def state_checksum(state: dict) -> str:
    """sha256 of the state's canonical JSON, without the checksum itself."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def layout_files(layout: dict, with_optimizer: bool) -> list:
    """The files a save in `layout` writes besides state.json: one weight (and optimizer)
    shard per (pipeline stage, tensor-parallel rank), one RNG file per rank."""
    pieces = [f"pp{p}-tp{t}" for p in range(layout["pp"]) for t in range(layout["tp"])]
    world = layout["dp"] * layout["pp"] * layout["cp"] * layout["tp"]
    return ([f"weights-{x}.safetensors" for x in pieces]
            + [f"optimizer-{x}.safetensors" for x in pieces] * with_optimizer
            + [f"rng-rank{r}.safetensors" for r in range(world)])


class _Fields:
    """Typed access to state.json's fields; a bad one is a CheckpointError naming it."""

    def __init__(self, state: dict, directory: str):
        self.state, self.directory = state, directory

    def fail(self, field: str, problem: str):
        raise CheckpointError(f"checkpoint {self.directory}: state.json field '{field}' "
                              f"{problem}; the file was damaged or edited: resume from "
                              f"another checkpoint")

    def get(self, field: str, kind, minimum=None, optional=False):
        value = self.state
        for part in field.split("."):
            if not isinstance(value, dict) or part not in value:
                if optional:
                    return None
                self.fail(field, "is missing")
            value = value[part]
        if optional and value is None:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join("null" if k is NULL else k.__name__ for k in kinds)
            self.fail(field, f"must be {names}, got {value!r}")
        if minimum is not None and value is not None and value < minimum:
            self.fail(field, f"must be >= {minimum}, got {value!r}")
        return value


def _saved_config(fields: _Fields):
    """A Config holding the saved SAVED_SETTINGS, and FUNCTION_SETTINGS, SCHEDULE_FIELDS and
    PRECISION_FIELDS or None where a checkpoint lacks them (the others at their defaults:
    unread)."""
    config = Config()
    for name, kind in SAVED_SETTINGS.items():
        section, key = name.split(".")
        low = None
        if kind is int:         # sizes count from 1; a seed and the validation windows from 0
            low = 0 if name in ("training.seed", "dataset.val_samples") else 1
        value = fields.get(f"config.{name}", kind, minimum=low)
        setattr(getattr(config, section), key, value)
    for name, kind in {**FUNCTION_SETTINGS, **SCHEDULE_FIELDS, **PRECISION_FIELDS}.items():
        section, key = name.split(".")
        setattr(getattr(config, section), key,
                fields.get(f"config.{name}", kind, optional=True))
    return config


def read_state(directory: str):
    """(state, the Config it was trained with: its SAVED_SETTINGS), after every check of
    state.json."""
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {e}); not a complete "
                              f"checkpoint: resume from another one") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a JSON {type(state).__name__}, not the object a "
                              f"checkpoint writes; resume from another checkpoint")
    fields = _Fields(state, directory)
    version = fields.get("format_version", int)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format_version {version}; this "
                              f"version of picotron reads {FORMAT_VERSION} (RNG states in "
                              f"safetensors, a checksummed state.json); resume from a "
                              f"checkpoint written by this version, or start a new run")
    if fields.get("state_sha256", str) != state_checksum(state):
        raise CheckpointError(f"{path} does not match the checksum it was written with: it "
                              f"was edited or damaged; resume from another checkpoint")
    step = fields.get("step", int, minimum=0)
    tokens = fields.get("tokens_seen", int, minimum=0)
    next_sample = fields.get("data.next_sample", int, minimum=0)
    batch = fields.get("data.global_batch_size", int, minimum=1)
    windows = fields.get("data.num_windows", (int, NULL), minimum=1)   # null: synthetic
    fields.get("data.contents", str, optional=True)          # absent: written before it was
    epoch = fields.get("data.epoch", int, minimum=0)
    layout = {k: fields.get(f"layout.{k}", int, minimum=1) for k in ("dp", "pp", "cp", "tp")}
    manifest = fields.get("sha256", dict)
    bad = [k for k, v in manifest.items() if not (isinstance(v, str) and len(v) == 64)
           or os.path.basename(k) != k or k == STATE_FILE]
    if bad:
        fields.fail("sha256", f"has entries that are not a file name and a sha256: {bad}")
    if fields.get("loss_scale", dict, optional=True) is not None:
        fields.get("loss_scale.scale", (int, float))
    if fields.get("fp8_amaxes", dict, optional=True) is not None:     # delayed FP8 scales
        fields.get("fp8_amaxes.dy_scale", int, minimum=1)
        amaxes = fields.get("fp8_amaxes.amaxes", dict)
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in amaxes.values()):
            fields.fail("fp8_amaxes.amaxes", "must map site names to numbers")
        fields.get("fp8_amaxes.rolls_since_saturation", int, optional=True, minimum=0)
    history = fields.get("accepted_changes", list, optional=True) or []
    fields.get("config", dict)
    config = _saved_config(fields)
    # ---- the fields agree with each other ------------------------------------------------
    name = os.path.basename(os.path.normpath(directory))
    if re.fullmatch(r"step_\d+", name) and int(name[5:]) != step:
        fields.fail("step", f"is {step} in a directory named {name}")
    if next_sample != step * batch:
        fields.fail("data.next_sample", f"is {next_sample}, but {step} steps of "
                                        f"data.global_batch_size {batch} end at {step * batch}")
    if epoch != (next_sample // windows if windows else 0):
        fields.fail("data.epoch", f"is {epoch}, not the epoch of sample {next_sample}")
    d = config.distributed
    if layout != {"dp": d.dp_size, "pp": d.pp_size, "cp": d.cp_size, "tp": d.tp_size}:
        fields.fail("layout", f"is {layout}, not the layout of its own config")
    if batch != config.global_batch_size:
        fields.fail("data.global_batch_size", f"is {batch}, its config's global batch is "
                                              f"{config.global_batch_size}")
    base_step, base_tokens = 0, 0            # tokens count from the last accepted change on
    for i, record in enumerate(history):
        if not isinstance(record, dict):
            fields.fail(f"accepted_changes.{i}", "must be an object")
        sub = _Fields(record, directory)
        base_step = sub.get("step", int, minimum=base_step)
        base_tokens = sub.get("tokens_seen", int, minimum=base_tokens)
        sub.get("changes", dict)
    seq = config.training.seq_length
    expected = base_tokens + (step - base_step) * batch * seq
    if base_step > step or tokens != expected:
        fields.fail("tokens_seen", f"is {tokens}, but the {step - base_step} steps of {batch} "
                                   f"sequences of {seq} tokens since step {base_step} "
                                   f"({base_tokens} tokens) make {expected}")
    return state, config


def directory_problems(directory: str, rank: int = 0, world: int = 1) -> tuple:
    """(state or None, saved Config or None, [problem, ...]): state.json's and every file's.
    This call hashes only files `rank::world` of the manifest; the union over ranks is the
    whole check."""
    try:
        state, config = read_state(directory)
    except CheckpointError as e:
        return None, None, [str(e)]
    manifest = state["sha256"]
    present = {e.name for e in os.scandir(directory) if e.is_file()}
    present_or_dir = set(os.listdir(directory))
    problems = [f"{directory}/{n}: listed in state.json but missing" for n in sorted(manifest)
                if n not in present]
    problems += [f"{directory}/{n}: not listed in state.json's manifest (the checkpoint "
                 f"holds a file it was not written with)" for n in sorted(present_or_dir)
                 if n not in manifest and n != STATE_FILE]
    expected = layout_files(state["layout"], with_optimizer="loss_scale" in state)
    problems += [f"{directory}/{n}: the saved layout writes this file, but state.json's "
                 f"manifest does not list it" for n in expected if n not in manifest]
    for i, name in enumerate(sorted(manifest)):
        if i % world != rank or name not in present:
            continue
        try:
            same = sha256(os.path.join(directory, name)) == manifest[name]
        except OSError as e:      # reported like any other problem, so the ranks still agree
            problems.append(f"{directory}/{name}: cannot be read ({e})")
            continue
        if not same:
            problems.append(f"{directory}/{name}: does not match the sha256 recorded when it "
                            f"was written; the file is corrupt")
    return state, config, problems
