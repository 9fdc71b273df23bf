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
"""
import os
import sysconfig

import torch

EMBEDDED_MAX_BYTES = 8 * 2 ** 20      # 8 MiB of source: ~30k windows of 256 tokens
DOCUMENT_SEPARATOR = 0                 # byte-level "end of document"


class DataError(ValueError):
    """The dataset section names data that cannot be loaded."""


def embedded_corpus_bytes(max_bytes: int = EMBEDDED_MAX_BYTES) -> torch.Tensor:
    """The stdlib's .py files in sorted path order, concatenated with separators: (N,) uint8."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(os.path.join(d, f) for d, dirs, files in os.walk(root)
                   if "site-packages" not in d for f in files if f.endswith(".py"))
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


def _generator(seed: int, *keys: int) -> torch.Generator:
    mixed = seed
    for k in keys:
        mixed = (mixed * 6364136223846793005 + k + 1442695040888963407) % (2 ** 63)
    return torch.Generator().manual_seed(mixed)


class SyntheticData:
    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def window(self, index: int) -> torch.Tensor:
        g = _generator(self.seed, 1, index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)


class PackedTokens:
    """A token stream cut into disjoint windows, visited in a fresh random order each epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int, num_samples=None):
        self.seq_len, self.seed = seq_len, seed
        self.num_windows = len(tokens) // (seq_len + 1)
        if num_samples is not None:
            self.num_windows = min(self.num_windows, num_samples)
        if self.num_windows == 0:
            raise DataError(f"the corpus has {len(tokens)} tokens, fewer than one window "
                                  f"of seq_length+1 = {seq_len + 1}; lower training.seq_length")
        self.windows = tokens[: self.num_windows * (seq_len + 1)].view(self.num_windows, -1)
        self._epoch, self._order = None, None

    def window(self, index: int) -> torch.Tensor:
        epoch, offset = divmod(index, self.num_windows)
        if epoch != self._epoch:   # each epoch is one permutation drawn from (seed, epoch)
            self._epoch = epoch
            self._order = torch.randperm(self.num_windows, generator=_generator(self.seed, 2, epoch))
        return self.windows[self._order[offset]].long()


def build_data(config):
    """The window source named by `dataset.name`."""
    d, t, m = config.dataset, config.training, config.model
    if d.name == "synthetic":
        return SyntheticData(t.seq_length, m.vocab_size, t.seed)
    if d.name == "embedded":
        if m.vocab_size < 256:
            raise DataError(f"the embedded corpus is byte-level and needs "
                                  f"model.vocab_size >= 256, got {m.vocab_size}")
        return PackedTokens(embedded_corpus_bytes(), t.seq_length, t.seed, d.num_samples)
    raise DataError(f"dataset.name='{d.name}' is not a known source; this version loads "
                          f"'embedded' (the built-in corpus) or 'synthetic'")


def micro_batch(data, step: int, micro: int, config, dp_rank: int):
    """(inputs, targets), each (micro_batch_size, seq_len), for one DP rank's micro-batch.

    step counts from 0. Within the global batch, micro-batch m of DP rank r holds samples
    (m * dp + r) * mbs ... + mbs - 1, so the same samples make up a step in every layout."""
    mbs, dp = config.training.micro_batch_size, config.distributed.dp_size
    first = step * config.global_batch_size + (micro * dp + dp_rank) * mbs
    windows = torch.stack([data.window(first + b) for b in range(mbs)])   # (mbs, T+1)
    return windows[:, :-1], windows[:, 1:]
