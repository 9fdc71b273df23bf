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
import glob
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from picotron import token_cache
from picotron.errors import DataError, SharedDataError
from picotron.tokenizer import TokenizerError, load_tokenizer, tokenizer_source

SAVED_METADATA = ("dataset_info.json", "dataset_dict.json", "state.json", "dataset_infos.json")
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def files_problem(files: list, whole_folder: bool = False):
    """Why these data files cannot be read as one dataset, else None: a file of a type the
    loader does not read (a folder's other files are its own business: README, scripts), or
    files of more than one format read together (one reader would take them all: a .jsonl
    read as text, or a .txt dropped). Said by create_config's checks and by the loader."""
    odd = sorted({os.path.splitext(f)[1].lower() or "extension-less" for f in files}
                 - set(FILE_BUILDERS))
    if odd and not whole_folder:
        return (f"cannot read {', '.join(repr(e) for e in odd)} files; use "
                f"{', '.join(FILE_BUILDERS)} files or a folder of them (or dataset.byte_range "
                f"to read a file's raw bytes)")
    kinds = {}
    for f in files:
        ext = os.path.splitext(f)[1].lower()
        if ext in FILE_BUILDERS:
            kinds.setdefault(FILE_BUILDERS[ext], []).append(os.path.basename(f))
    if len(kinds) < 2:
        return None
    listed = "; ".join(f"{k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
                       for k, v in sorted(kinds.items()))
    return (f"holds data files of {len(kinds)} formats ({listed}), which are not read "
            f"together; keep one format, or a glob that matches one (e.g. '*.jsonl')")


def data_files(folder: str) -> list:
    """The data files under `folder`: hidden ones (.cache) and the metadata that
    `save_to_disk` writes beside its .arrow files left out."""
    found = []
    for d, dirs, names in os.walk(folder):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        found += [os.path.join(d, f) for f in names
                  if not f.startswith(".") and f not in SAVED_METADATA]
    return found


def _local_reason(e: Exception) -> str:
    """Why `datasets` could not read local files: the error under its generic
    DatasetGenerationError (a UnicodeDecodeError, a JSON parse error), or no rows at all."""
    cause = e.__cause__ or e
    if isinstance(cause, StopIteration) or not str(cause).strip():
        return "no rows could be read (is a file empty?)"
    if isinstance(cause, UnicodeDecodeError):
        return f"{_first_line(cause)} (files must be UTF-8 text)"
    return _first_line(cause)


def load_documents(d, split: str):
    """The rows of `split` as a datasets.Dataset, with the text column checked."""
    import datasets
    name = os.path.expanduser(d.name)
    files = sorted(glob.glob(name)) if any(c in name for c in "*?[") else []
    try:
        if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in
                                       SAVED_METADATA[:3]):
            splits = datasets.load_from_disk(name)          # written by save_to_disk
        elif os.path.isdir(name):
            problem = files_problem(data_files(name), whole_folder=True)
            if problem:
                raise DataError(f"dataset.name='{d.name}': {problem}")
            splits = datasets.load_dataset(name, d.subset_name)   # builder inferred from files
        elif os.path.isfile(name) or files:
            files = files or [name]
            problem = files_problem(files)
            if problem:
                raise DataError(f"dataset.name='{d.name}': {problem}")
            ext = os.path.splitext(files[0])[1].lower()
            splits = datasets.load_dataset(FILE_BUILDERS[ext], data_files={"train": files})
        elif name.startswith(("/", ".", "~")) or os.path.splitext(name)[1] in FILE_BUILDERS:
            raise DataError(f"dataset.name='{d.name}' looks like a local path but nothing "
                            f"exists there; check the path (relative paths are resolved from "
                            f"{os.getcwd()})")
        else:
            splits = datasets.load_dataset(name, d.subset_name, split=split)
    except DataError:
        raise
    except Exception as e:
        if os.path.exists(name) or files:    # the files are there: say what is wrong in them
            raise DataError(f"could not read the local dataset dataset.name='{d.name}': "
                            f"{_local_reason(e)}; fix or remove the file, or point "
                            f"dataset.name at other files") from None
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
    total = int(np.sum(tokenized["n"])) if len(tokenized) else 0
    chunks = (np.fromiter((t for x in batch["ids"] for t in x), dtype=np.int64)
              for batch in tokenized.iter(batch_size=1024))   # bounded memory, in row order
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.int32
    path = token_cache.write(root, key, chunks, total, dtype, {
        "source": d.name, "split": split, "documents": len(docs), "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size, "eos_token_id": eos})
    print(f"tokenized {len(docs)} documents of {d.name}:{split} with {tokenizer.name} into "
          f"{total} tokens -> {path}", flush=True)
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
