"""What create_config.py checks on this machine before it writes a config: that the data and
the tokenizer the run will read can be found. A typo in a path then fails in a second, here,
instead of a minute into train.py, after the model is built and the tokenizer loaded.

Only cheap checks: nothing is tokenized or downloaded, and at most a file's first 100 rows
or its schema are read.
- `dataset.name` that looks like a local path (it starts with `.`, `/` or `~`, has a data
  file's extension or glob characters, has more than one `/`, or exists) must exist, and its
  files (a folder's too) must be of one format the loader reads, and their first 100 rows
  must make a dataset (data/local_files.py: some data file, not all empty, UTF-8, JSON lines that
  parse, no file with a column the first file read lacks); a file or glob holds one split,
  "train", and no validation split (that would be the training data); a key of its first
  file's first 100 rows must be `dataset.text_column` (a .txt file's one column is "text").
  A folder of data files holds the splits its file names make (train.jsonl,
  validation.jsonl, ...); a folder written by `save_to_disk` holds the splits and columns it
  lists. With `dataset.byte_range`, the file must hold the ranges' bytes. A name of the form
  "name" or "owner/name" that is no local path is a Hugging Face hub id.
- The tokenizer, when the dataset needs one (not `embedded`, `synthetic` or a byte range):
  `dataset.tokenizer`, else the model's. It must fit `model.vocab_size` (bytes: 256), and a
  local folder must load (offline).
- A hub id (dataset, tokenizer, or `checkpoint.init_from`) when the hub cannot be reached
  (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set, or no network): it must be in the local Hugging
  Face cache, or the run would fail to download it. With a network, hub ids are left to the
  loader.

`create_config.py --skip_local_checks` skips all of this, for a config written here to run
on another machine.
"""
import json
import os
import socket
import threading

from picotron.config.ranges import HUB_ID
from picotron.data.local_files import (FILE_BUILDERS, GLOB_CHARS, SAVED_METADATA, file_columns,
                                       local_files, local_problem, saved_dataset, text_problem)
from picotron.data.tokenizer import TokenizerError, load_tokenizer, tokenizer_source

OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
FIX_OFFLINE = "load it once with a network (it is then cached here)"


def local_problems(config, probe_network=None) -> list:
    """Every problem of `config` that this machine can see cheaply, each naming its fix.
    `probe_network() -> None or why the hub cannot be reached` (default: hub_offline)."""
    d, weights = config.dataset, config.checkpoint.init_from
    answers = []

    def offline():                       # asked at most once, for all the hub ids
        if not answers:
            answers.append((probe_network or hub_offline)())
        return answers[0]
    problems = []
    if weights and not os.path.isdir(os.path.expanduser(weights)) and not looks_local(weights):
        problems += hub_problems(weights, "model", f"checkpoint.init_from={weights!r} (the "
                                 f"weights to start from)", offline)
    if d.name in ("embedded", "synthetic"):
        return problems
    if d.byte_range is not None:
        return problems + byte_file_problems(d)
    return problems + dataset_problems(d, offline) + tokenizer_problems(config, offline)


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a path here rather than a hub id ('name' or 'owner/name')."""
    path = os.path.expanduser(name)
    return (name.startswith((".", "/", "~")) or os.path.lexists(path)
            or any(c in name for c in GLOB_CHARS) or name.count("/") > 1
            or os.path.splitext(name)[1].lower() in FILE_BUILDERS
            or not HUB_ID.fullmatch(name))


def dataset_problems(d, probe_network) -> list:
    key = f"dataset.name={d.name!r} (--dataset_name)"
    if not looks_local(d.name):
        return hub_problems(d.name, "dataset", key, probe_network)
    path = os.path.expanduser(d.name)
    if saved_dataset(path):
        return saved_dataset_problems(d, path)
    files = local_files(path)
    if os.path.isdir(path):
        problem = local_problem(path, files)
        return [f"{key}: {problem}"] if problem else folder_split_problems(d, path)
    if not files:
        what = "matches no file" if any(c in d.name for c in GLOB_CHARS) else "does not exist"
        return [f"{key} {what} (a relative path is read from the folder train.py starts in, "
                f"here {os.getcwd()}); give an existing file, glob or folder, or a Hugging "
                f"Face dataset id ('owner/name')"]
    problem = local_problem(path, files)
    if problem:
        return [f"{key}: {problem}"]
    problems = []
    if d.split != "train":
        problems.append(f"dataset.split={d.split!r}: a file or glob holds one split, 'train'; "
                        f"set dataset.split to 'train', or give a folder with a file per split")
    if d.val_split is not None:      # 'train' too: validation would score trained windows
        problems.append(f"dataset.val_split={d.val_split!r}: a file or glob holds one split, "
                        f"the training data; set dataset.val_split to null (dataset.val_samples "
                        f"windows are then held out of training), or give a folder with a "
                        f"file per split")
    columns, not_text = file_columns(files[0]), text_problem(files[0], d.text_column)
    if columns is not None and d.text_column not in columns:
        problems.append(f"dataset.text_column={d.text_column!r}: {files[0]} has no such "
                        f"column, its columns are {columns}; set dataset.text_column to one "
                        f"of them (--set dataset.text_column=NAME)")
    elif not_text:
        problems.append(f"dataset.text_column={d.text_column!r}: {not_text}")
    return problems


def saved_dataset_problems(d, folder: str) -> list:
    """A `save_to_disk` folder: its splits (dataset_dict.json) and columns (dataset_info.json)
    are written beside the data. Another folder of data files is left to the loader."""
    splits_file = os.path.join(folder, "dataset_dict.json")
    info = os.path.join(folder, "dataset_info.json")
    problems = []
    if os.path.isfile(splits_file):
        with open(splits_file) as f:
            splits = json.load(f).get("splits", [])
        problems += [f"dataset.{k}={split!r}: the dataset at {folder} has no such split, its "
                     f"splits are {splits}; set dataset.{k} to one of them"
                     for k, split in (("split", d.split), ("val_split", d.val_split))
                     if split is not None and split not in splits]
        if d.split in splits:
            info = os.path.join(folder, d.split, "dataset_info.json")
    if os.path.isfile(info):
        with open(info) as f:
            columns = list(json.load(f).get("features") or {})
        if columns and d.text_column not in columns:
            problems.append(f"dataset.text_column={d.text_column!r}: the dataset at {folder} "
                            f"has no such column, its columns are {columns}; set "
                            f"dataset.text_column to one of them")
    return problems


def folder_split_problems(d, folder: str) -> list:
    """A folder of data files: its splits as the loader will find them, named by the files
    (datasets' own rule: train.jsonl, validation-00.parquet, dev.txt, ...; all 'train' when
    no name says a split). A README.md may map files to splits itself: left to the loader."""
    from datasets.data_files import get_data_patterns
    if any(os.path.exists(os.path.join(folder, f)) for f in SAVED_METADATA + ("README.md",)):
        return []
    try:
        splits = sorted(map(str, get_data_patterns(folder)))
    except Exception:        # no data files, or none it can read: the loader says which
        return []
    return [f"dataset.{k}={split!r}: the folder {folder} has no such split; the names of its "
            f"files make the splits {splits} (e.g. train.jsonl and validation.jsonl); set "
            f"dataset.{k} to one of them, or name the files after the splits"
            for k, split in (("split", d.split), ("val_split", d.val_split))
            if split is not None and split not in splits]


def byte_file_problems(d) -> list:
    """dataset.byte_range reads the bytes of one local file: it must exist and hold them."""
    path = os.path.expanduser(d.name)
    if not os.path.isfile(path):
        return [f"dataset.name={d.name!r} (--dataset_name): dataset.byte_range reads a local "
                f"file's bytes, and there is no file there (relative to {os.getcwd()}); fix "
                f"the path"]
    size = os.path.getsize(path)
    return [f"dataset.{k}={r} ends past the end of {d.name} ({size:,} bytes); make the range "
            f"end at {size} or before" for k, r in (("byte_range", d.byte_range),
                                                    ("val_byte_range", d.val_byte_range))
            if r is not None and r[1] > size]


def tokenizer_problems(config, probe_network) -> list:
    try:
        source = tokenizer_source(config)
    except TokenizerError as e:
        return [str(e)]
    key = (f"dataset.tokenizer={source!r}" if config.dataset.tokenizer
           else f"the model's tokenizer '{source}' (from --model_name; dataset.tokenizer "
                f"picks another)")
    if source == "byte":
        return [] if config.model.vocab_size >= 256 else [
            f"{key}: the byte-level tokenizer has 256 tokens but model.vocab_size="
            f"{config.model.vocab_size}; use --set model.vocab_size=256 or another tokenizer"]
    if not os.path.isdir(os.path.expanduser(source)):
        if looks_local(source):          # a missing local path: the config's checks say so
            return []
        return hub_problems(source, "model", key, probe_network)
    try:
        tokenizer = load_tokenizer(os.path.expanduser(source))
    except TokenizerError as e:
        return [f"{key}: {e}"]
    if tokenizer.vocab_size > config.model.vocab_size:
        return [f"{key}: the tokenizer at {source} has {tokenizer.vocab_size} tokens but "
                f"model.vocab_size={config.model.vocab_size}; use a model vocabulary at least "
                f"that large (--set model.vocab_size={tokenizer.vocab_size}) or another "
                f"tokenizer"]
    return []


def hub_problems(repo_id: str, kind: str, key: str, probe_network) -> list:
    """A hub id is fine when it is cached here or the hub can be reached."""
    if in_hub_cache(repo_id, kind):
        return []
    offline = probe_network()
    if offline is None:
        return []
    if kind == "dataset":
        return [f"{key} is no local path (nothing there, relative to {os.getcwd()}), and as "
                f"a Hugging Face dataset id it is not in this machine's cache while the hub "
                f"cannot be reached ({offline}); fix the path, or {FIX_OFFLINE}"]
    return [f"{key} is a Hugging Face hub id that is not in this machine's cache, and the hub "
            f"cannot be reached ({offline}); give a local folder, or {FIX_OFFLINE}"]


def in_hub_cache(repo_id: str, kind: str) -> bool:
    """Whether `repo_id` has files in the hub cache (or, for a dataset, a prepared copy in the
    datasets cache), where an offline load finds it."""
    from huggingface_hub import constants
    folder = f"{kind}s--{repo_id.replace('/', '--')}"
    if os.path.isdir(os.path.join(constants.HF_HUB_CACHE, folder, "snapshots")):
        return True
    if kind != "dataset":
        return False
    prepared = (os.environ.get("HF_DATASETS_CACHE")
                or os.path.join(constants.HF_HOME, "datasets"))
    return os.path.isdir(os.path.join(prepared, repo_id.replace("/", "___")))


def hub_offline(timeout_s: float = 3.0):
    """None when the hub answers, else why not: an offline switch is set, or the hub's host
    does not answer a connection within `timeout_s` (the name lookup included: it runs in a
    thread that is not waited for longer)."""
    for switch in OFFLINE_SWITCHES:
        if os.environ.get(switch, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{switch}={os.environ[switch]} is set"
    from urllib.parse import urlparse

    from huggingface_hub import constants
    host = urlparse(constants.ENDPOINT).hostname
    answered = []

    def connect():
        try:
            socket.create_connection((host, 443), timeout=timeout_s).close()
            answered.append(True)
        except OSError:
            pass
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return None if answered else f"{host} does not answer: no network"
