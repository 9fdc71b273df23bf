"""Training data as a numbered list of (seq_len + 1)-token windows, and the batches of a step.

Every source exposes `window(i)` for a global sample index i = 0, 1, 2, ... that runs on
across epochs. The global batch of optimizer step k is samples [k*G, (k+1)*G) with
G = micro_batch_size * grad_acc_steps * dp_size, whatever the layout; a DP rank takes its
share of each micro-batch. The data position is therefore one number, the step.

Sources:
- "embedded": the text of this Python's standard library (found through `sysconfig`), so a
  default corpus exists on any machine, tokenized byte-level (vocab 256) as in the enwik8
  setup. Documents (files) are separated by byte 0, which never occurs in Python source.
- "synthetic": uniform random tokens drawn from the seed and the sample index.
- a local file with `dataset.byte_range` [start, stop): its bytes as they are, one stream (token
  = byte value, no documents, no tokenizer), memory-mapped: enwik8's setup. The validation
  windows come from `dataset.val_byte_range`, another range of the same file.
- anything else: a Hugging Face dataset (hub id or local files), tokenized once into a cache
  and packed the same way (picotron/data/tokenized.py).

Validation: `dataset.val_samples` windows held out, from `dataset.val_split` (or
`val_byte_range`) when given, else carved off the end of the training stream before shuffling
(so no training window overlaps them). They are read in order, never shuffled.
"""
import hashlib
import os
import sysconfig

import numpy as np
import torch

from picotron.context_parallel.sharding import shard_sequence
from picotron.errors import DataError  # noqa: F401  (re-exported: the entry points catch it)
from picotron.data.tokenizer import is_byte_tokenizer

EMBEDDED_MAX_BYTES = 8 * 2 ** 20      # 8 MiB of source: ~30k windows of 256 tokens
DOCUMENT_SEPARATOR = 0                 # byte-level "end of document"


def embedded_corpus_bytes(max_bytes: int = EMBEDDED_MAX_BYTES) -> torch.Tensor:
    """The stdlib's .py files in sorted path order, concatenated with separators: (N,) uint8."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        # pruned, not just skipped: site-packages holds most of the tree's folders
        dirs[:] = [x for x in dirs if "site-packages" not in x]
        paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
    paths.sort()
    chunks, total = [], 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read().replace(b"\0", b"") + bytes([DOCUMENT_SEPARATOR])
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise DataError(f"no Python source found under {root} for the embedded corpus; "
                              f"use dataset.name='synthetic'")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def file_bytes(path: str, byte_range: list, key: str) -> torch.Tensor:
    """Bytes [start, stop) of a local file, (stop - start,) uint8, memory-mapped copy-on-write
    (pages are read when a window needs them; the file is never written)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"dataset.{key} reads the bytes of a local file, but dataset.name="
                        f"'{path}' is not a file; give the path of the file (e.g. enwik8)")
    start, stop = byte_range
    size = os.path.getsize(path)
    if stop > size:
        raise DataError(f"dataset.{key}={byte_range} ends past the end of {path} ({size} "
                        f"bytes); lower its stop to at most {size}")
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=start,
                                      shape=(stop - start,)))


def byte_ranges(config):
    """(train, validation) windows of `dataset.byte_range` and `val_byte_range` of one file;
    without val_byte_range, val_samples windows are carved off the end of the training range.
    num_samples caps the training windows (they are windows here, as for "embedded")."""
    d, t = config.dataset, config.training
    train_bytes = file_bytes(d.name, d.byte_range, "byte_range")
    if d.val_byte_range is None:
        train, val = split_stream(train_bytes, config, d.num_samples)
        train.contents = stream_sha256(train_bytes)
        return train, val
    windows = len(train_bytes) // (t.seq_length + 1)
    train = PackedTokens(train_bytes, t.seq_length, t.seed,
                         count=min(windows, d.num_samples or windows))
    train.contents = stream_sha256(train_bytes)
    if not d.val_samples:
        return train, None
    val_bytes = file_bytes(d.name, d.val_byte_range, "val_byte_range")
    count = min(d.val_samples, len(val_bytes) // (t.seq_length + 1))
    if count == 0:
        raise DataError(f"dataset.val_byte_range={d.val_byte_range} holds {len(val_bytes)} "
                        f"bytes, fewer than one window of seq_length+1 = {t.seq_length + 1}; "
                        f"widen it")
    return train, PackedTokens(val_bytes, t.seq_length, t.seed, 0, count, shuffle=False)


def stream_sha256(tokens: torch.Tensor) -> str:
    """The sha256 of a token stream read whole (a byte range of a file, the embedded corpus):
    a resume compares it, as it compares the token cache's for tokenized datasets."""
    return hashlib.sha256(tokens.numpy()).hexdigest()


def _generator(seed: int, *keys: int) -> torch.Generator:
    mixed = seed
    for k in keys:
        mixed = (mixed * 6364136223846793005 + k + 1442695040888963407) % (2 ** 63)
    return torch.Generator().manual_seed(mixed)


class SyntheticData:
    def __init__(self, seq_len: int, vocab_size: int, seed: int, stream: int = 1):
        self.seq_len, self.vocab_size, self.seed, self.stream = seq_len, vocab_size, seed, stream

    def window(self, index: int) -> torch.Tensor:
        g = _generator(self.seed, self.stream, index)     # stream 1: training, 3: validation
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)


class PackedTokens:
    """Windows [first, first + count) of a token stream cut into disjoint (seq_len+1)-token
    windows, visited in a fresh random order each epoch (shuffle=False: in order, once).

    tokens: (N,) integer tensor, possibly a memory-mapped cache file (never copied whole).
    Window j is tokens[j*(T+1) : (j+1)*(T+1)]; the remainder of the stream is dropped."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int, first: int = 0,
                 count: int = None, shuffle: bool = True):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.first = first
        self.num_windows = len(tokens) // (seq_len + 1) - first if count is None else count
        if self.num_windows <= 0:
            raise DataError(f"the corpus has {len(tokens)} tokens, too few for one window of "
                            f"seq_length+1 = {seq_len + 1} tokens (after {first} held-out "
                            f"windows); lower training.seq_length or dataset.val_samples, or "
                            f"use more data")
        self._epoch, self._order = None, None
        self.contents = None          # the stream's sha256 (None: not known)

    def __len__(self) -> int:
        return self.num_windows

    def window(self, index: int) -> torch.Tensor:
        epoch, offset = divmod(index, self.num_windows)
        if self.shuffle and epoch != self._epoch:   # one permutation per (seed, epoch)
            self._epoch = epoch
            self._order = torch.randperm(self.num_windows,
                                         generator=_generator(self.seed, 2, epoch))
        j = self.first + (int(self._order[offset]) if self.shuffle else offset)
        size = self.seq_len + 1
        return self.tokens[j * size:(j + 1) * size].long()


def split_stream(tokens, config, max_windows=None):
    """(train, val) PackedTokens over one stream: the last `val_samples` windows are held out
    (val is None when val_samples is 0). max_windows caps the windows used in all."""
    t, v = config.training, config.dataset.val_samples
    total = len(tokens) // (t.seq_length + 1)
    if max_windows is not None:
        total = min(total, max_windows)
    if v and v >= total:
        raise DataError(f"dataset.val_samples={v} holds out every one of the {total} windows "
                        f"of seq_length+1 = {t.seq_length + 1} tokens; lower it")
    train = PackedTokens(tokens, t.seq_length, t.seed, 0, total - v)
    val = PackedTokens(tokens, t.seq_length, t.seed, total - v, v, shuffle=False) if v else None
    return train, val


def build_data(config, run_dir=None):
    """The training window source named by `dataset.name`."""
    return build_train_val(config, run_dir)[0]


def build_train_val(config, run_dir=None):
    """(train, validation) window sources; validation is None when dataset.val_samples is 0.

    A Hugging Face dataset is tokenized by rank 0 into a cache under `run_dir` while the other
    ranks wait (collective when a process group exists: every rank calls it)."""
    d, t, m = config.dataset, config.training, config.model
    if d.name == "synthetic":
        val = SyntheticData(t.seq_length, m.vocab_size, t.seed, 3) if d.val_samples else None
        return SyntheticData(t.seq_length, m.vocab_size, t.seed), val
    if d.name == "embedded":
        if m.vocab_size < 256:
            raise DataError(f"the embedded corpus is byte-level and needs "
                            f"model.vocab_size >= 256, got {m.vocab_size}")
        if (config.checkpoint.init_from and d.tokenizer != "byte"
                and not is_byte_tokenizer(config.checkpoint.init_from)):
            raise DataError(f"the embedded corpus is byte-level, but the weights of "
                            f"{config.checkpoint.init_from} expect their own tokenizer; set "
                            f"dataset.name to a dataset (it is tokenized with the model's "
                            f"tokenizer), or dataset.tokenizer='byte' if you mean it")
        # num_samples counts windows here (the corpus has no rows).
        corpus = embedded_corpus_bytes()
        train, val = split_stream(corpus, config, d.num_samples)
        train.contents = stream_sha256(corpus)
        return train, val
    if d.byte_range is not None:
        return byte_ranges(config)
    from picotron.data.tokenized import dataset_tokens
    train_tokens, contents = dataset_tokens(config, d.split, run_dir)
    if d.val_split is None:
        train, val = split_stream(train_tokens, config)
    else:
        train, val = PackedTokens(train_tokens, t.seq_length, t.seed), None
    train.contents = contents            # the stream's sha256: a resume compares it
    if d.val_split is None or not d.val_samples:
        return train, val
    val_tokens, _ = dataset_tokens(config, d.val_split, run_dir)
    count = min(d.val_samples, len(val_tokens) // (t.seq_length + 1))
    return train, PackedTokens(val_tokens, t.seq_length, t.seed, 0, count, shuffle=False)


def data_state(config, step: int, data) -> dict:
    """The data position after `step` optimizer steps, as saved in a checkpoint."""
    next_sample = step * config.global_batch_size
    num = getattr(data, "num_windows", None)
    return {"next_sample": next_sample, "global_batch_size": config.global_batch_size,
            "num_windows": num, "epoch": next_sample // num if num else 0,
            "contents": getattr(data, "contents", None)}


def micro_batch(data, step: int, micro: int, config, pgm):
    """(inputs, targets), each (micro_batch_size, seq_len), for DP rank pgm.dp_rank's
    micro-batch (one process: `ProcessGroupManager()`).

    step counts from 0. Within the global batch, micro-batch m of DP rank r holds samples
    (m * dp + r) * mbs ... + mbs - 1, so the same samples make up a step in every layout."""
    mbs, accum = config.training.micro_batch_size, config.training.gradient_accumulation_steps
    dp = pgm.dp_size
    first = ((step * accum + micro) * dp + pgm.dp_rank) * mbs    # step * global batch + ...
    windows = torch.stack([data.window(first + b) for b in range(mbs)])   # (mbs, T+1)
    return windows[:, :-1], windows[:, 1:]


class StepBatches:
    """The micro-batches a step trains on, on the device: `get(step, micro)` gives this rank's
    (inputs, targets, position_ids), each (micro_batch_size, seq_len / cp): its DP share of
    the samples (micro_batch) and its CP share of the tokens (shard_sequence).

    `prefetch(step)` builds a step's micro-batches ahead of time. train.py calls it for the
    next step before it waits for this step's loss: the windows are cut and the copies to
    the GPU queued while the GPU still runs this step's backward and optimizer, instead of
    the GPU idling through that host work at the start of every step (up to ~2% of a step
    at SmolLM-360M's size on an H200: bench/NOTES.md). The values are the same either way."""

    def __init__(self, data, config, pgm, device):
        self.data, self.config, self.pgm, self.device = data, config, pgm, device
        self.ready = (None, [])             # (step, its micro-batches) from prefetch

    def prefetch(self, step: int) -> None:
        accum = self.config.training.gradient_accumulation_steps
        self.ready = (step, [self._build(step, micro) for micro in range(accum)])

    def get(self, step: int, micro: int):
        if self.ready[0] == step:
            return self.ready[1][micro]
        return self._build(step, micro)

    def _build(self, step: int, micro: int):
        inputs, targets = micro_batch(self.data, step, micro, self.config, self.pgm)
        batch = shard_sequence(inputs, targets, self.pgm.cp_rank, self.pgm.cp_size)
        if self.device.type != "cuda":
            return batch
        # pinned host memory: the copy is queued and the host goes on (the caching host
        # allocator keeps the pinned block until the copy has run)
        return tuple(x.contiguous().pin_memory().to(self.device, non_blocking=True)
                     for x in batch)
