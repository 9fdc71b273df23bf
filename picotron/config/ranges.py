"""The allowed range of every number in the config, where its names point, and whether a
folder can be written.

A value that no check looks at reaches torch as a traceback from deep inside (a NaN learning
rate, adam_beta2 = 1, a hidden size of 0, a seed of 2^70) or, worse, trains silently wrong (a
NaN weight decay, an infinite clipping norm, a negative rope_theta). So every int and float
field has a range in RANGES below, checked by `config.config_from_dict` at load time, before
the layout checks (picotron/config/checks.py), which divide and compare these numbers and so
need them in range. A range is closed unless marked open; a float must also be a number, and
since every range has a finite upper end, NaN and infinity are refused everywhere.

The caps on sizes are far above any model trained so far, and keep the element counts of the
largest tensors inside int64: the logits' mbs*T*V <= 2^61, a V*C embedding, a C*I matrix. A
size that is merely too large for the machine's memory is refused when the run is built, from
an estimate (picotron/plan/memory_plan.py), not here.
"""
import os
import re
from dataclasses import dataclass
from typing import Optional


MAX_STEPS = 2 ** 40          # a million steps a second would take 35 years
MAX_RANKS = 2 ** 16          # processes along one axis of the grid


@dataclass(frozen=True)
class Range:
    """low <= value <= high; `open_low` / `open_high` make that end strict (<)."""
    low: float
    high: float
    open_low: bool = False
    open_high: bool = False

    def problem(self, value) -> Optional[str]:
        """None when `value` lies in the range, else what is wrong ('must be >= 1')."""
        if value != value:                                  # NaN equals nothing
            return "is not a number"
        if value < self.low or (self.open_low and value == self.low):
            return f"must be {'>' if self.open_low else '>='} {number(self.low)}"
        if value > self.high or (self.open_high and value == self.high):
            return f"must be {'<' if self.open_high else '<='} {number(self.high)}"
        return None

    def __str__(self) -> str:
        return (f"{'(' if self.open_low else '['}{number(self.low)}, {number(self.high)}"
                f"{')' if self.open_high else ']'}")


def number(x) -> str:
    """2^40 for large powers of two, else the shortest readable form."""
    if isinstance(x, int) and x >= 2 ** 20 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


# field -> (range, what the number is and why the range). Optional fields are checked only
# when set. training.activation_checkpointing_layers is checked against num_hidden_layers in
# picotron/config/checks.py, the only number whose range depends on another.
CHECKED_WITH_THE_LAYOUT = ("training.activation_checkpointing_layers",)
RANGES = {
    "distributed.dp_size": (Range(1, MAX_RANKS), "model replicas that split the batch"),
    "distributed.tp_size": (Range(1, MAX_RANKS), "shards of every weight matrix"),
    "distributed.pp_size": (Range(1, MAX_RANKS), "pipeline stages"),
    "distributed.cp_size": (Range(1, MAX_RANKS), "shards of every sequence"),
    "distributed.pp_virtual_stages": (Range(1, 2 ** 12), "model chunks per pipeline rank"),
    "distributed.zero_stage": (Range(0, 3), "0: plain data parallel, 1: shard the optimizer "
                                            "state, 2: and the gradients, 3: and the "
                                            "parameters"),
    "distributed.bucket_size_mb": (Range(0, 2 ** 20, open_low=True),
                                   "megabytes of gradients per all-reduce bucket"),
    "distributed.offload_optim_frac": (Range(0, 1), "the fraction of the optimizer state kept "
                                                    "on the CPU"),
    "distributed.timeout_s": (Range(0, 86400, open_low=True),
                              "seconds a collective may wait before the run fails; a rank "
                              "blocked for a day is dead, and torch's timedelta overflows"),
    "distributed.heartbeat_s": (Range(0, 86400, open_low=True),
                                "seconds without a heartbeat before a rank counts as dead"),
    "distributed.cpu_threads": (Range(1, 4096), "intra-op CPU threads per process"),
    "model.vocab_size": (Range(2, 2 ** 21), "tokens in the vocabulary (the largest models "
                                            "have about 2^18)"),
    "model.hidden_size": (Range(2, 2 ** 17), "the width C of every layer"),
    "model.intermediate_size": (Range(1, 2 ** 20), "the MLP's inner width"),
    "model.num_hidden_layers": (Range(1, 2 ** 12), "decoder layers"),
    "model.num_attention_heads": (Range(1, 2 ** 12), "query heads"),
    "model.num_key_value_heads": (Range(1, 2 ** 12), "key/value heads"),
    "model.max_position_embeddings": (Range(1, 2 ** 24), "the longest sequence; positions "
                                                         "are exact in fp32 up to 2^24"),
    "model.rope_theta": (Range(1, 1e12, open_low=True),
                         "RoPE's base: the frequencies theta^(-2i/d) must fall with i"),
    "model.rms_norm_eps": (Range(0, 1, open_low=True), "added to the mean square under the "
                                                       "square root, so a zero vector stays "
                                                       "finite"),
    "model.initializer_range": (Range(0, 1, open_low=True), "the std of the normal init; 0 "
                                                            "would make every weight zero"),
    "training.seed": (Range(0, 2 ** 63, open_high=True), "torch's generators take 64-bit "
                                                         "seeds"),
    "training.learning_rate": (Range(0, 1), "AdamW's peak step; 0 freezes the weights"),
    "training.min_lr_ratio": (Range(0, 1), "the cosine's floor, a fraction of learning_rate"),
    "training.warmup_steps": (Range(0, MAX_STEPS), "steps of linear warm-up"),
    "training.total_train_steps": (Range(1, MAX_STEPS), "optimizer steps"),
    "training.micro_batch_size": (Range(1, 2 ** 16), "sequences per micro-batch per DP rank"),
    "training.gradient_accumulation_steps": (Range(1, 2 ** 20), "micro-batches per step"),
    "training.seq_length": (Range(1, 2 ** 24), "tokens per sequence"),
    "training.max_grad_norm": (Range(0, 1e6), "the global-norm clip; 0 disables clipping "
                                              "(a larger norm would never clip either)"),
    "training.weight_decay": (Range(0, 10), "AdamW's decoupled decay"),
    "training.adam_beta1": (Range(0, 1, open_high=True),
                            "the decay of AdamW's first moment; 1 never forgets and divides "
                            "by zero in the bias correction"),
    "training.adam_beta2": (Range(0, 1, open_high=True),
                            "the decay of AdamW's second moment; 1 never forgets and divides "
                            "by zero in the bias correction"),
    "training.adam_eps": (Range(0, 1, open_low=True), "added to AdamW's denominator, so a "
                                                      "zero gradient gives a zero step"),
    "training.initial_loss_scale": (Range(1, 2 ** 32), "float16's starting loss scale; one "
                                                       "skipped step halves it"),
    "training.loss_scale_window": (Range(1, MAX_STEPS), "good steps before the loss scale "
                                                        "doubles"),
    "training.val_frequency": (Range(0, MAX_STEPS), "steps between validations; 0: never"),
    "training.divergence_factor": (Range(0, 1e6), "times its best the loss may stay above "
                                                  "before the run stops as diverged; 0: never"),
    "training.divergence_steps": (Range(1, MAX_STEPS), "steps in a row above it that stop "
                                                       "the run"),
    "training.max_skipped_steps": (Range(0, MAX_STEPS), "skipped steps in a row that stop the "
                                                        "run; 0: never stop"),
    "training.loss_chunk_tokens": (Range(0, 2 ** 30), "tokens per chunk of the chunked "
                                                      "losses; 0: the default chunk"),
    "dataset.num_samples": (Range(1, 2 ** 40), "rows (windows for 'embedded') kept; null: all"),
    "dataset.num_proc": (Range(1, 1024), "processes that tokenize"),
    "dataset.val_samples": (Range(0, 2 ** 40), "held-out validation windows"),
    "dataset.cache_max_gb": (Range(0, 2 ** 30), "the token cache's size cap in GB; 0: none"),
    "checkpoint.save_frequency": (Range(0, MAX_STEPS), "steps between checkpoints; 0: none"),
    "checkpoint.keep_last": (Range(0, 2 ** 20), "checkpoints kept; 0: all"),
    "logging.log_frequency": (Range(1, MAX_STEPS), "steps between stdout lines"),
}

# A Hugging Face hub id: "name" or "owner/name" of letters, digits, '-', '_', '.'.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def range_errors(config) -> list:
    """Every field of `config` outside its range, with the value, the range and the default.
    `config` is a `picotron.config.Config`, read through its sections' attributes."""
    errors = []
    for key, (allowed, why) in RANGES.items():
        section_name, name = key.split(".")
        section = getattr(config, section_name)
        value = getattr(section, name)
        problem = None if value is None else allowed.problem(value)
        if problem:
            default = getattr(type(section)(), name)
            errors.append(f"{key}={value!r} {problem} ({why}); set it in {allowed}, e.g. "
                          f"{'null' if default is None else repr(default)} (the default)")
    return errors + source_errors(config) + byte_range_errors(config)


def source_errors(config) -> list:
    """Names that must name something and point somewhere. A tokenizer or weights given as a
    local path that does not exist would be tried as a hub id; the embedded corpus is byte-
    level and would ignore any other tokenizer. A hub id is left to the loader (checking it
    needs the network)."""
    d = config.dataset
    names = (("name", "dataset ('embedded', 'synthetic', a path or a hub id)"),
             ("split", "split to train on, e.g. 'train'"), ("text_column", "column of the text"))
    errors = [f"dataset.{key}={getattr(d, key)!r} is empty; name the {what}"
              for key, what in names if not getattr(d, key).strip()]
    if d.val_split is not None and d.val_split == d.split:
        errors.append(f"dataset.val_split={d.val_split!r} is the training split "
                      f"(dataset.split): validation would score windows the run trains on; "
                      f"set dataset.val_split to null (dataset.val_samples windows are then "
                      f"held out of training) or to another split")
    if d.name == "embedded" and d.tokenizer not in (None, "byte"):
        errors.append(f"dataset.tokenizer={d.tokenizer!r} would be ignored: dataset.name="
                      f"'embedded' is byte-level; set dataset.tokenizer to null or 'byte', or "
                      f"train on a dataset that this tokenizer should encode")
    for key, value in (("dataset.tokenizer", d.tokenizer),
                       ("checkpoint.init_from", config.checkpoint.init_from)):
        path = None if value is None else os.path.expanduser(value)
        if value is None or os.path.isdir(path) or (key == "dataset.tokenizer"
                                                     and value == "byte"):
            continue
        if os.path.lexists(path):
            errors.append(f"{key}={value!r} is a file, not a folder; give the folder that "
                          f"holds it")
        elif not HUB_ID.fullmatch(value) or ".." in value:
            errors.append(f"{key}={value!r} is not a local folder (nothing exists there) and "
                          f"does not look like a Hugging Face hub id ('owner/name'); fix the "
                          f"path")
    return errors


def unwritable(folder: str) -> Optional[str]:
    """None when `folder` is (or can be made) a writable directory, else why not."""
    existing, problem = _nearest_existing(folder)
    if problem:
        return problem
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == os.path.abspath(folder) else " (the part of the path that exists)"
        return f"'{existing}'{where} is not writable by this user; choose another folder"
    return None


def not_a_folder(folder: str) -> Optional[str]:
    """None when `folder` is (or could be made) a directory, else the file in its way."""
    return _nearest_existing(folder)[1]


def _nearest_existing(folder: str) -> tuple:
    """(the nearest part of `folder` that exists, why it cannot hold the folder or None)."""
    folder = os.path.abspath(folder)
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    where = "" if existing == folder else " (the part of the path that exists)"
    if not os.path.isdir(existing):
        return existing, (f"'{existing}'{where} is not a folder (a file or a broken link); "
                          f"remove it or choose another folder")
    return existing, None


def byte_range_errors(config) -> list:
    """dataset.byte_range and val_byte_range: [start, stop) of one local file's bytes, with
    0 <= start < stop, the validation range apart from the training one, and byte tokens."""
    d, errors = config.dataset, []
    ranges = [(k, v) for k, v in (("dataset.byte_range", d.byte_range),
                                  ("dataset.val_byte_range", d.val_byte_range)) if v is not None]
    for key, value in ranges:
        if not (len(value) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                        for x in value) and 0 <= value[0] < value[1]):
            errors.append(f"{key}={value!r} must be [start, stop], two whole numbers with "
                          f"0 <= start < stop (bytes [start, stop) of the file), e.g. "
                          f"[0, 90000000]")
    if not ranges or errors:
        return errors
    if d.byte_range is None:
        errors.append("dataset.val_byte_range is set without dataset.byte_range; set the "
                      "training range too, e.g. [0, 90000000]")
    elif d.val_byte_range is not None and (d.val_byte_range[0] < d.byte_range[1]
                                           and d.byte_range[0] < d.val_byte_range[1]):
        errors.append(f"dataset.val_byte_range={d.val_byte_range} overlaps dataset.byte_range="
                      f"{d.byte_range}: validation would score bytes it trained on; make them "
                      f"disjoint")
    if d.name in ("embedded", "synthetic"):
        errors.append(f"dataset.byte_range reads a local file's bytes, but dataset.name="
                      f"'{d.name}'; set dataset.name to the file's path")
    if d.tokenizer not in (None, "byte") or config.model.vocab_size < 256:
        errors.append(f"dataset.byte_range makes every byte a token: it needs dataset.tokenizer "
                      f"null or 'byte' (got {d.tokenizer!r}) and model.vocab_size >= 256 (got "
                      f"{config.model.vocab_size})")
    if d.val_split is not None:
        errors.append("dataset.val_split names a split of a Hugging Face dataset, but "
                      "dataset.byte_range reads a raw file; use dataset.val_byte_range")
    return errors
