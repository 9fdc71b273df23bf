"""A token cache shared by every run on the machine: a dataset is tokenized once, not once per
run directory, and a cache hit loads neither the tokenizer nor the dataset.

An entry is named by a key computed from cheap fingerprints only:
- the data: for local files, each file's absolute path, size and modification time (a
  directory counts every file under it); for a hub dataset, its id and the commit that the
  local Hugging Face cache resolves `main` to (datasets reads the same snapshot offline);
- the tokenizer: "byte" is a constant; a local or cached hub tokenizer is the sha256 of the
  files of its folder (weights left out);
- the packing settings: split, subset, text column, number of documents, and FORMAT, the
  version of the packing rule (one EOS after each non-empty document).
When a fingerprint cannot be taken without loading (a hub dataset or tokenizer not downloaded
yet), the caller loads it and fingerprints what it loaded instead.

An entry is two files in the cache directory: `<key>.npy`, the (N,) token stream, and
`<key>.json`, what it holds (token count, dtype, the tokenizer's vocabulary size and EOS) and
the sha256 of the .npy file. Both are written to a temporary name and renamed, the .json last:
an entry without its .json is not there yet, so two runs tokenizing the same data at once never
read half a file (both write the same bytes; the last rename wins). A hit re-reads the .npy's
sha256 (about 2 GB/s), so a truncated or damaged entry is found and rebuilt, not trained on.

Size. Each entry's .json carries its last use as its modification time (set when written,
touched at every hit). Writing an entry then trims the cache to `dataset.cache_max_gb`,
removing the least recently used entries first (the .json first, so no reader finds an entry
without its tokens), but never the entry just written nor one used in the last hour: a run
that has just looked an entry up opens it a moment later on every rank, and one already
running has it mapped (a removed file stays readable to whoever has it open). A full disk
would fail the checkpoint writes of every run on the machine; a removed entry costs one
tokenization.
"""
import contextlib
import glob
import hashlib
import json
import os
import tempfile
import time

import numpy as np

from picotron.utils import readable_as_usual, sha256    # sha256 of a file

FORMAT = "picotron-tokens-v1"
# A tokenizer folder (often a model folder) is fingerprinted by every file in it but weights:
# whichever files a tokenizer reads (tokenizer.json, vocab + merges, a sentencepiece model,
# its config) are then covered.
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                ".onnx")


def default_cache_dir() -> str:
    """The user's cache folder, as the XDG convention places it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "picotron", "tokenized")


def cache_dir(config, run_dir=None) -> str:
    """`dataset.cache_dir` (a relative path is taken from the run directory, like the
    checkpoints), or the user's cache folder when it is null."""
    folder = os.path.expanduser(config.dataset.cache_dir or default_cache_dir())
    return os.path.abspath(os.path.join(run_dir or ".", folder))


def _file_stamp(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def _hub_snapshot(repo_id: str, kind: str):
    """(commit, snapshot dir) that the local Hugging Face cache resolves `main` of a hub repo
    to, or None when it was never downloaded (or `repo_id` is not an org/name id)."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    from huggingface_hub import constants
    folder = os.path.join(constants.HF_HUB_CACHE, f"{kind}s--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(folder, "refs", "main")) as f:
            commit = f.read().strip()
    except OSError:
        return None
    return commit, os.path.join(folder, "snapshots", commit)


def data_fingerprint(name: str):
    """The fingerprint of `dataset.name`'s files, or None when it takes loading to know (a hub
    dataset not in the local cache, or a path that does not exist: loading then says why)."""
    path = os.path.expanduser(name)
    # How the files are read is part of the print: a folder's files are split by name
    # (train/test), a file or glob is read whole as 'train', so the same files differ.
    mode = "files"
    if any(c in path for c in "*?["):
        files = sorted(glob.glob(path))
    elif os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files, mode = [], "folder"
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))    # .cache and the like
            files += [os.path.join(folder, f) for f in sorted(names) if not f.startswith(".")]
    else:
        hub = _hub_snapshot(name, "dataset")
        return None if hub is None else f"hub:{name}@{hub[0]}"
    return f"{mode}:" + "|".join(_file_stamp(f) for f in files) if files else None


def tokenizer_fingerprint(source: str):
    """The fingerprint of tokenizer `source` ("byte", a directory or a hub id), or None when it
    takes loading the tokenizer to know."""
    if source == "byte":
        return "byte"
    folder = source if os.path.isdir(source) else None
    if folder is None:
        hub = _hub_snapshot(source, "model")
        folder = hub[1] if hub is not None else None
    if folder is None:
        return None
    present = sorted(f for f in os.listdir(folder) if not f.endswith(WEIGHT_FILES)
                     and not f.startswith(".") and os.path.isfile(os.path.join(folder, f)))
    if not any(f.startswith("tokenizer") for f in present):
        return None                 # not a tokenizer folder: loading it says why
    h = hashlib.sha256()
    for f in present:
        h.update(f.encode() + b"\0" + sha256(os.path.join(folder, f)).encode())
    return "files:" + h.hexdigest()


def cache_key(*parts) -> str:
    return hashlib.sha256("\x00".join([FORMAT, *map(str, parts)]).encode()).hexdigest()[:24]


def lookup(root: str, key: str):
    """(path of the .npy, its description) when a complete, undamaged entry exists, else
    None. A damaged entry is reported and left to be overwritten."""
    npy, meta_path = os.path.join(root, key + ".npy"), os.path.join(root, key + ".json")
    if not os.path.exists(meta_path):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        tokens = np.load(npy, mmap_mode="r")
        problem = None
        if tokens.shape != (meta["tokens"],) or str(tokens.dtype) != meta["dtype"]:
            problem = (f"holds {tokens.shape} {tokens.dtype}, not ({meta['tokens']},) "
                       f"{meta['dtype']}")
        elif sha256(npy) != meta["sha256"]:
            problem = "its sha256 differs from the one written with it"
    except (OSError, ValueError, KeyError, TypeError) as e:    # missing, truncated, garbage
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if problem is None:
        with contextlib.suppress(OSError):     # a cache another user owns: read, not touched
            os.utime(meta_path)                # last used now (the module docstring, Size)
        return npy, meta
    print(f"token cache entry {npy} is damaged ({problem}); tokenizing again", flush=True)
    return None


def entry_sha256(npy: str):
    """The sha256 of an entry's tokens, as written in its description (None if unreadable)."""
    try:
        with open(npy[:-len(".npy")] + ".json") as f:
            return json.load(f).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None


def remove_stale_temporaries(root: str, older_than_s: float = 86400.0) -> None:
    """Delete the temporary files of writers that died (a day old: a live writer's file is
    younger, its mtime moving as it writes)."""
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):        # another run may remove it first
            if name.startswith(".tmp-") and now - os.path.getmtime(path) > older_than_s:
                os.remove(path)


def _atomic_path(root: str, suffix: str) -> str:
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    readable_as_usual(tmp)     # mkstemp makes it 0600: others sharing the cache could not read
    return tmp


def write(root: str, key: str, chunks, total: int, dtype, meta: dict) -> str:
    """Write the `total` tokens that `chunks` (an iterable of 1-D int arrays) yields as entry
    `key`, atomically (the .npy first, then the .json that makes it visible); its path."""
    os.makedirs(root, exist_ok=True)
    remove_stale_temporaries(root)
    npy = os.path.join(root, key + ".npy")
    tmp = _atomic_path(root, ".npy")
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", shape=(total,), dtype=dtype)
        pos = 0
        for flat in chunks:
            out[pos:pos + len(flat)] = flat
            pos += len(flat)
        out.flush()
        del out
        if pos != total:
            raise RuntimeError(f"the token stream has {pos} tokens, {total} were announced")
        meta = {**meta, "tokens": total, "dtype": np.dtype(dtype).name, "sha256": sha256(tmp)}
        os.replace(tmp, npy)
        tmp = _atomic_path(root, ".json")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(root, key + ".json"))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return npy


def trim(root: str, max_gb: float, keep: str, grace_s: float = 3600.0) -> list:
    """Remove the least recently used entries until the cache holds at most max_gb (0: no
    cap), sparing `keep` and every entry used within grace_s (module docstring, Size); the
    keys removed. Says what it removed, and when what it may not remove is over the cap."""
    if max_gb <= 0:
        return []
    entries = []
    for meta in glob.glob(os.path.join(root, "*.json")):
        key = os.path.basename(meta)[:-len(".json")]
        with contextlib.suppress(OSError):     # another run may remove it meanwhile
            size = os.path.getsize(meta) + os.path.getsize(os.path.join(root, key + ".npy"))
            entries.append((os.path.getmtime(meta), key, size))
    total, cap, now, removed = sum(e[2] for e in entries), max_gb * 1e9, time.time(), []
    for used, key, size in sorted(entries):                     # least recently used first
        if total <= cap:
            break
        if key == keep or now - used < grace_s:
            continue
        for suffix in (".json", ".npy"):                        # invisible first
            with contextlib.suppress(OSError):
                os.remove(os.path.join(root, key + suffix))
        total -= size
        removed.append(key)
    if removed:
        print(f"token cache {root}: removed {len(removed)} least recently used entries "
              f"({', '.join(removed)}) to stay under dataset.cache_max_gb={max_gb:g}",
              flush=True)
    if total > cap:
        print(f"token cache {root} holds {total / 1e9:.1f} GB, over dataset.cache_max_gb="
              f"{max_gb:g}, in entries used within the last hour (or the one just written); "
              f"raise the cap or point dataset.cache_dir at a larger disk", flush=True)
    return removed
