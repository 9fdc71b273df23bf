"""A Hugging Face dataset -> one token stream with EOS between documents, tokenized once.

`dataset.name` is a local path (a directory, a file, or a glob of .txt / .json / .jsonl /
.parquet / .arrow / .csv files, or a folder written by `Dataset.save_to_disk`) or a hub id.
Rank 0 looks the data up in the token cache shared by every run (token_cache.py: keyed by the
files' fingerprints, the tokenizer's and the packing settings, so a hit loads neither the
tokenizer nor the dataset). On a miss it loads the split, keeps the first `num_samples` rows
(documents, as picotron does), tokenizes the `text_column` with `datasets.map` and writes the
stream as one .npy entry of the cache. Every other rank waits at a broadcast and then
memory-maps that file, so the corpus is tokenized once, not once per rank nor once per run.
A failure on rank 0 (missing file, wrong column) is sent to every rank, so all of them stop
with the same message instead of hanging.
"""
import contextlib
import logging
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from picotron.data import token_cache
from picotron.config.ranges import unwritable
from picotron.errors import DataError, SharedDataError
from picotron.data.local_files import (FILE_BUILDERS, contents_problem, local_files, local_problem,
                                       saved_dataset)
from picotron.data.tokenizer import TokenizerError, load_tokenizer, tokenizer_source


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _local_reason(e: Exception, files, folder) -> str:
    """Why `datasets` could not read local files, in words that name the file and the fix:
    every row of `files` looked at now (the first rows passed before the load), else the
    error under its generic DatasetGenerationError put plainly."""
    cause = e.__cause__ or e
    problem = contents_problem(files, rows=None, folder=folder) if files else None
    if problem:
        return problem
    if (isinstance(cause, StopIteration) or not str(cause).strip()
            or type(cause).__name__ == "SchemaInferenceError"):
        return "no rows could be read (is a file empty?); give files that hold text"
    if isinstance(cause, UnicodeDecodeError):
        return (f"a file is not UTF-8 text ({cause.reason}); files must be UTF-8 text: save "
                f"them as UTF-8")
    if "BuilderConfig" in str(cause):     # load_dataset(folder, subset): no such config
        return (f"dataset.subset_name names no configuration of it ({str(cause).strip()}); "
                f"set dataset.subset_name to one of those, or to null")
    if type(cause).__name__ == "CastError":   # a column that rows of the first file lack
        return ("some rows have columns that the first rows read do not have; give files "
                "whose rows have the same columns")
    return f"{_first_line(cause)}; fix or remove the file, or point dataset.name at others"


@contextlib.contextmanager
def _builders_quiet():
    """`datasets`' file readers log an error (the JSON reader: the file and pyarrow's parse
    error) just before they raise it; the raise becomes one message here, so silence the
    log, which would say it a second time in the library's words."""
    logger = logging.getLogger("datasets.packaged_modules")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_documents(d, split: str):
    """The rows of `split` as a datasets.Dataset, with the text column checked."""
    import datasets
    name = os.path.expanduser(d.name)
    saved = saved_dataset(name)
    folder = name if os.path.isdir(name) else None     # read split by split
    files = local_files(name)
    if not saved and (files or folder):                 # said before datasets reads a row
        problem = local_problem(name, files)
        if problem:
            raise DataError(f"dataset.name='{d.name}': {problem}")
    try:
        with _builders_quiet():
            if saved:
                splits = datasets.load_from_disk(name)
            elif folder:                                    # builder inferred from files
                splits = datasets.load_dataset(name, d.subset_name)
            elif files:
                ext = os.path.splitext(files[0])[1].lower()
                splits = datasets.load_dataset(FILE_BUILDERS[ext], data_files={"train": files})
            elif name.startswith(("/", ".", "~")) or os.path.splitext(name)[1] in FILE_BUILDERS:
                raise DataError(f"dataset.name='{d.name}' looks like a local path but nothing "
                                f"exists there; check the path (relative paths are resolved "
                                f"from {os.getcwd()})")
            else:
                splits = datasets.load_dataset(name, d.subset_name, split=split)
    except DataError:
        raise
    except Exception as e:
        if os.path.exists(name) or files:    # the files are there: say what is wrong in them
            raise DataError(f"could not read the local dataset dataset.name='{d.name}': "
                            f"{_local_reason(e, None if saved else files, folder)}") from None
        raise DataError(f"could not load dataset.name='{d.name}' (subset {d.subset_name!r}, "
                        f"split {split!r}): {_first_line(e)}; give an existing local path or "
                        f"a Hugging Face dataset id (offline machines need local files)"
                        ) from None
    if isinstance(splits, datasets.DatasetDict):
        if split not in splits:
            raise DataError(f"dataset '{d.name}' has no split '{split}'; its splits are "
                            f"{sorted(splits)}: set dataset.split (or dataset.val_split)")
        splits = splits[split]
    if d.text_column not in splits.column_names:
        raise DataError(f"dataset '{d.name}' has no column '{d.text_column}'; its columns are "
                        f"{splits.column_names}: set dataset.text_column to one of them")
    kind = getattr(splits.features[d.text_column], "dtype", None)
    if kind == "null":                       # every row's value is null: nothing to train on
        raise DataError(f"dataset '{d.name}' column '{d.text_column}' is null in every row: "
                        f"it holds no text; fill it, or set dataset.text_column to a column "
                        f"of strings (its columns are {splits.column_names})")
    if type(splits.features[d.text_column]).__name__ == "Json":  # mixed: text and others
        row, value = next(((i, v) for i, v in enumerate(splits[d.text_column], 1)
                           if v is not None and not isinstance(v, str)), (None, None))
        raise DataError(f"dataset '{d.name}' column '{d.text_column}' holds text in some rows "
                        f"but {type(value).__name__} {repr(value)[:40]} in row {row}; make "
                        f"every row's '{d.text_column}' a string (quote numbers), or remove "
                        f"those rows")
    if kind not in ("string", "large_string"):
        raise DataError(f"dataset '{d.name}' column '{d.text_column}' holds "
                        f"{kind or type(splits.features[d.text_column]).__name__}, not text; "
                        f"set dataset.text_column to a column of strings "
                        f"(its columns are {splits.column_names})")
    if d.num_samples is not None:
        splits = splits.select(range(min(d.num_samples, len(splits))))
    return splits


def _fingerprints(config, split: str):
    """(cache key, tokenizer or None, documents or None): the key from cheap fingerprints,
    loading the tokenizer or the documents only when they cannot be fingerprinted unloaded."""
    d = config.dataset
    name = os.path.expanduser(d.name)
    if d.subset_name and (os.path.isfile(name) or any(c in name for c in "*?[")):
        print(f"warning: dataset.subset_name={d.subset_name!r} is ignored: it picks a "
              f"configuration of a hub dataset, and dataset.name='{d.name}' is local files",
              file=sys.stderr, flush=True)
    source = tokenizer_source(config)
    tokenizer, docs = None, None
    tok_print = token_cache.tokenizer_fingerprint(source)
    if tok_print is None:                    # a hub tokenizer not downloaded yet
        tokenizer = _checked_tokenizer(config, source)
        tok_print = (token_cache.tokenizer_fingerprint(source)    # downloaded now
                     or f"{tokenizer.name}:{tokenizer.fingerprint()}")
    data_print = token_cache.data_fingerprint(d.name)
    if data_print is None:                   # a hub dataset not downloaded yet (or no path)
        docs = load_documents(d, split)
        data_print = (token_cache.data_fingerprint(d.name)        # downloaded now
                      or f"datasets:{getattr(docs, '_fingerprint', '')}")
    key = token_cache.cache_key(data_print, d.subset_name, split, d.text_column,
                                d.num_samples, tok_print)
    return key, tokenizer, docs


def _checked_tokenizer(config, source: str):
    tokenizer = load_tokenizer(source)
    _check_vocab(tokenizer.name, tokenizer.vocab_size, config.model.vocab_size)
    return tokenizer


def _check_vocab(name: str, size: int, vocab: int) -> None:
    if size > vocab:
        raise TokenizerError(f"tokenizer '{name}' has {size} tokens but model.vocab_size="
                             f"{vocab}; use a model vocabulary at least that large or another "
                             f"tokenizer")


def _tokenize_to_file(config, split: str, root: str) -> str:
    """Rank 0's work: the cache entry of this data and tokenizer, tokenized and written to
    `root` (token_cache.py) unless it is there already."""
    d = config.dataset
    key, tokenizer, docs = _fingerprints(config, split)
    hit = token_cache.lookup(root, key)
    if hit is not None:
        path, meta = hit
        _check_vocab(meta["tokenizer"], meta["vocab_size"], config.model.vocab_size)
        print(f"token cache hit for {d.name}:{split}: {meta['tokens']} tokens <- {path}",
              flush=True)
        return path
    problem = unwritable(root)          # said now, not after the tokenizing (hours at scale)
    if problem:
        raise DataError(f"{d.name}:{split} has no usable entry in the token cache, and the "
                        f"cache '{root}' cannot be written: {problem}; set dataset.cache_dir "
                        f"to a writable folder")
    tokenizer = tokenizer or _checked_tokenizer(config, tokenizer_source(config))
    docs = docs if docs is not None else load_documents(d, split)
    eos, column = tokenizer.eos_token_id, d.text_column

    def encode(batch):   # one EOS after every non-empty document
        ids = tokenizer.batch_encode([t or "" for t in batch[column]])
        ids = [x + [eos] if x else [] for x in ids]
        return {"ids": ids, "n": [len(x) for x in ids]}

    tokenized = docs.map(encode, batched=True, num_proc=d.num_proc if d.num_proc > 1 else None,
                         remove_columns=docs.column_names, new_fingerprint=f"picotron-{key}",
                         desc=f"tokenizing {d.name}:{split}")
    lengths = np.asarray(tokenized["n"], dtype=np.int64)
    total, textless = int(lengths.sum()), int((lengths == 0).sum())
    chunks = (np.fromiter((t for x in batch["ids"] for t in x), dtype=np.int64)
              for batch in tokenized.iter(batch_size=1024))   # bounded memory, in row order
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.int32
    path = token_cache.write(root, key, chunks, total, dtype, {
        "source": d.name, "split": split, "documents": len(docs), "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size, "eos_token_id": eos,
        "documents_without_text": textless})
    # Rows whose text is missing, null or empty add no tokens and no EOS: say how many, once,
    # since a column misspelt in some files or a broken export shows up only here.
    left_out = (f" ({textless} of them without text: missing, null or empty, left out)"
                if textless else "")
    print(f"tokenized {len(docs)} documents of {d.name}:{split}{left_out} with "
          f"{tokenizer.name} into {total} tokens -> {path}", flush=True)
    token_cache.trim(root, d.cache_max_gb, keep=key)
    return path


def dataset_tokens(config, split: str, run_dir=None) -> tuple:
    """((N,) token stream of `split`, its sha256), from the token cache (`dataset.cache_dir`,
    relative to `run_dir`). The sha256 (written with the cache entry) names the contents, so
    a resume can tell files edited in place. Collective when a process group exists: every
    rank calls it."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    root = token_cache.cache_dir(config, run_dir)
    box = [None, None]                                   # [path, error message]
    if not distributed or dist.get_rank() == 0:
        try:
            box[0] = _tokenize_to_file(config, split, root)
        except DataError as e:        # told to every rank below, raised everywhere
            box[1] = str(e)
        except Exception as e:
            box[1] = f"preparing the data failed: {_first_line(e)}"
    if distributed:
        dist.broadcast_object_list(box, src=0)
        if box[1] is None:            # another machine may not see rank 0's cache folder
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, os.path.exists(box[0]))
            if not all(seen):
                box[1] = (f"the token cache {box[0]} written by rank 0 is not visible on "
                          f"ranks {[r for r, s in enumerate(seen) if not s]}; set "
                          f"dataset.cache_dir to a folder every machine shares")
    if box[1] is not None:
        raise SharedDataError(box[1]) if distributed else DataError(box[1])
    # Copy-on-write map: pages are read on demand, the file is never written.
    return (torch.from_numpy(np.load(box[0], mmap_mode="c")),
            token_cache.entry_sha256(box[0]))
