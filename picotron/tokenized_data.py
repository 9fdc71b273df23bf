"""A Hugging Face dataset -> one token stream with EOS between documents, tokenized once.

`dataset.name` is a local path (a directory, a file, or a glob of .txt / .json / .jsonl /
.parquet / .arrow / .csv files, or a folder written by `Dataset.save_to_disk`) or a hub id.
Rank 0 loads the split, keeps the first `num_samples` rows (documents, as picotron does),
tokenizes the `text_column` with `datasets.map` (cached by `datasets` under a fingerprint of
the data and the tokenizer), and writes the stream as one .npy file under
`<run dir>/data_cache/`. Every other rank waits at a broadcast and then memory-maps that file,
so the corpus is tokenized once, not once per rank. A failure on rank 0 (missing file, wrong
column) is sent to every rank, so all of them stop with the same message instead of hanging.
"""
import glob
import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist

from picotron.errors import DataError
from picotron.tokenizer import TokenizerError, load_tokenizer, tokenizer_source

FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def load_documents(d, split: str):
    """The rows of `split` as a datasets.Dataset, with the text column checked."""
    import datasets
    name = os.path.expanduser(d.name)
    files = sorted(glob.glob(name)) if any(c in name for c in "*?[") else []
    try:
        if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in
                                       ("dataset_info.json", "dataset_dict.json", "state.json")):
            splits = datasets.load_from_disk(name)          # written by save_to_disk
        elif os.path.isdir(name):
            splits = datasets.load_dataset(name, d.subset_name)   # builder inferred from files
        elif os.path.isfile(name) or files:
            files = files or [name]
            ext = os.path.splitext(files[0])[1].lower()
            if ext not in FILE_BUILDERS:
                raise DataError(f"dataset.name='{d.name}': cannot read '{ext}' files; use "
                                f"{', '.join(FILE_BUILDERS)} files or a directory of them")
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
    if d.num_samples is not None:
        splits = splits.select(range(min(d.num_samples, len(splits))))
    return splits


def _cache_key(config, split: str, docs, tokenizer) -> str:
    d = config.dataset
    fingerprint = tokenizer.fingerprint() if hasattr(tokenizer, "fingerprint") else "byte"
    parts = [d.name, str(d.subset_name), split, d.text_column, str(d.num_samples),
             getattr(docs, "_fingerprint", ""), fingerprint]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _tokenize_to_file(config, split: str, cache_dir: str) -> str:
    """Rank 0's work: load, tokenize, pack with EOS, write `<cache_dir>/tokens-<key>.npy`."""
    d, vocab = config.dataset, config.model.vocab_size
    tokenizer = load_tokenizer(tokenizer_source(config))
    if tokenizer.vocab_size > vocab:
        raise TokenizerError(f"tokenizer '{tokenizer.name}' has {tokenizer.vocab_size} tokens "
                             f"but model.vocab_size={vocab}; use a model vocabulary at least "
                             f"that large or another tokenizer")
    docs = load_documents(d, split)
    key = _cache_key(config, split, docs, tokenizer)
    path = os.path.join(cache_dir, f"tokens-{key}.npy")
    if os.path.exists(path):
        return path
    eos, column = tokenizer.eos_token_id, d.text_column

    def encode(batch):   # one EOS after every non-empty document
        ids = tokenizer.batch_encode([t or "" for t in batch[column]])
        ids = [x + [eos] if x else [] for x in ids]
        return {"ids": ids, "n": [len(x) for x in ids]}

    tokenized = docs.map(encode, batched=True, num_proc=d.num_proc if d.num_proc > 1 else None,
                         remove_columns=docs.column_names, new_fingerprint=f"picotron-{key}",
                         desc=f"tokenizing {d.name}:{split}")
    total = int(np.sum(tokenized["n"])) if len(tokenized) else 0
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + f".tmp{os.getpid()}.npy"
    out = np.lib.format.open_memmap(tmp, mode="w+", shape=(total,),
                                    dtype=np.uint16 if vocab <= 2 ** 16 else np.int32)
    pos = 0
    for batch in tokenized.iter(batch_size=1024):        # bounded memory, in row order
        flat = np.fromiter((t for x in batch["ids"] for t in x), dtype=np.int64)
        out[pos:pos + len(flat)] = flat
        pos += len(flat)
    out.flush()
    del out
    os.replace(tmp, path)           # atomic: a reader never sees a half-written cache
    print(f"tokenized {len(docs)} documents of {d.name}:{split} with {tokenizer.name} into "
          f"{total} tokens -> {path}", flush=True)
    return path


def dataset_tokens(config, split: str, run_dir=None) -> torch.Tensor:
    """(N,) token stream of `split`. Collective when a process group exists."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if run_dir is None:      # one process, no run directory (tests, notebooks): in memory
        if distributed:
            raise DataError("a Hugging Face dataset on several ranks needs a run directory "
                            "for the shared token cache")
        import tempfile
        with tempfile.TemporaryDirectory(prefix="picotron-data-") as tmp:
            return torch.from_numpy(np.load(_tokenize_to_file(config, split, tmp)))
    cache_dir = os.path.join(run_dir, "data_cache")
    box = [None, None]                                   # [path, error message]
    if not distributed or dist.get_rank() == 0:
        try:
            box[0] = _tokenize_to_file(config, split, cache_dir)
        except DataError as e:        # told to every rank below, raised everywhere
            box[1] = str(e)
        except Exception as e:
            box[1] = f"preparing the data failed: {_first_line(e)}"
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise DataError(box[1])
    # Copy-on-write map: pages are read on demand, the file is never written.
    return torch.from_numpy(np.load(box[0], mmap_mode="c"))
