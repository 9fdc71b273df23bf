"""A local dataset's files, and what a look at their first rows can tell is wrong with them.

create_config.py's checks (run/preflight.py) and the loader (tokenized.py) ask the same
questions here, so a config is refused for the same reason, in the same words, as train.py
would refuse it; and train.py asks them before `datasets` reads anything, since the library's
own errors (CastError, SchemaInferenceError, EmptyDatasetError) name neither the file nor the
fix. A look is cheap: the first LOOK_ROWS rows of each file, a parquet or arrow schema, a CSV
header, or a whole JSON document of at most WHOLE_JSON_BYTES. With `rows=None` every row is
read: the loader does that only after `datasets` failed, to name the file and line.
"""
import csv
import glob
import itertools
import json
import os

SAVED_METADATA = ("dataset_info.json", "dataset_dict.json", "state.json", "dataset_infos.json")
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
GLOB_CHARS = "*?["
LOOK_ROWS = 100
WHOLE_JSON_BYTES = 16 << 20
ENCODING = "utf-8-sig"     # UTF-8, a leading byte-order mark dropped (as `datasets` drops it)


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


def saved_dataset(path: str) -> bool:
    """Whether `path` is a folder written by `save_to_disk` (read by `load_from_disk`)."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                       for f in SAVED_METADATA[:3])


def data_files(folder: str) -> list:
    """The files under `folder`, sorted: hidden ones (.cache) and the metadata that
    `save_to_disk` writes beside its .arrow files left out."""
    found = []
    for d, dirs, names in os.walk(folder):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        found += [os.path.join(d, f) for f in names
                  if not f.startswith(".") and f not in SAVED_METADATA]
    return sorted(found)


def local_files(path: str) -> list:
    """The data files a local dataset.name names: a folder's (data_files), a file, or a
    glob's matches, sorted; [] when nothing is there."""
    if os.path.isdir(path):
        return data_files(path)
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(path)) if any(c in path for c in GLOB_CHARS) else []


def local_problem(path: str, files: list):
    """Why the files `path` names (local_files) make no dataset, else None: files_problem,
    then contents_problem (a folder's files read split by split)."""
    folder = path if os.path.isdir(path) else None
    return (files_problem(files, whole_folder=folder is not None)
            or contents_problem(files, folder=folder))


def contents_problem(files: list, rows=LOOK_ROWS, folder: str = None):
    """Why `files` (a folder's files, or those of a file or glob; of one format) hold no
    dataset, from their first `rows` rows, else None: no data file at all, only empty files,
    a file that is not UTF-8, a JSON-lines row that is not JSON, or a file with a column that
    the first file read lacks. Each reason names the file and the fix. `folder`: the folder
    the files make a dataset of (its files are read split by split)."""
    data = [f for f in files if os.path.splitext(f)[1].lower() in FILE_BUILDERS]
    if not data:
        held = (f"it holds only {_listed([os.path.basename(f) for f in files])}" if files
                else "it is empty")
        return (f"holds no data files ({held}); put {', '.join(FILE_BUILDERS)} "
                f"files there, or point dataset.name at the data files")
    base = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in data])
    short = {f: os.path.relpath(os.path.abspath(f), base) for f in data}
    if all(_empty(f) for f in data):   # one empty file among others is read as no rows
        return (f"{_listed(list(short.values()))} {'is' if len(data) == 1 else 'are'} empty: "
                f"no rows could be read; give files that hold text")
    columns = {}
    for f in data:
        try:
            columns[f] = file_columns(f, rows)
        except UnicodeDecodeError as e:
            return (f"{short[f]} is not UTF-8 text ({e.reason}: byte 0x"
                    f"{e.object[e.start:e.start + 1].hex()}); files must be UTF-8 text: save "
                    f"it as UTF-8")
        except NotJson as e:
            return (f"{short[f]} line {e.line} is not JSON ({e.reason}); fix or remove that "
                    f"line (a .jsonl file holds one JSON object per line)")
    # `datasets` takes its columns from the first file it reads: a later file's column that
    # one lacks is a CastError (the reverse, a column the later file lacks, reads as nulls).
    known = [(f, c) for f, c in ((f, columns[f]) for f in read_order(data, folder)) if c]
    first, first_columns = known[0] if known else (None, [])
    for f, c in known[1:]:
        extra = sorted(set(c) - set(first_columns))
        if extra:
            return (f"{short[f]} has columns that {short[first]}, the first file read, lacks "
                    f"({', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}; "
                    f"{short[first]} has {', '.join(sorted(first_columns)[:6])}): the "
                    f"dataset takes the first file's columns; give every file the same columns")
    return None


def read_order(files: list, folder: str = None) -> list:
    """`files` in the order `datasets` reads them: a folder's split by split, its splits as
    its file names make them (train first), each in name order; else in name order."""
    if folder is not None:
        try:
            from datasets.data_files import DataFilesDict, get_data_patterns
            splits = DataFilesDict.from_patterns(get_data_patterns(folder), base_path=folder)
            rank = {os.path.abspath(f): i for i, f in enumerate(
                f for split in splits.values() for f in split)}
            return sorted(files, key=lambda f: (rank.get(os.path.abspath(f), len(rank)), f))
        except Exception:       # no pattern matches: the loader reads them all as one split
            pass
    return sorted(files)


class NotJson(ValueError):
    """A row of a JSON file that does not parse: its line, for the message to name."""

    def __init__(self, line: int, reason: str):
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def file_columns(path: str, rows=LOOK_ROWS):
    """The column names of a data file from its first `rows` rows or its schema (a key that
    only some rows hold is still a column); None when that is not cheap to tell (a large
    JSON document, a damaged parquet file: the loader will say). Raises UnicodeDecodeError,
    or NotJson for a row of a JSON file that does not parse."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext in (".txt", ".text"):
            with open(path, encoding=ENCODING) as f:
                for _ in itertools.islice(f, rows):      # only to meet a non-UTF-8 line
                    pass
            return ["text"]
        if ext == ".parquet":
            import pyarrow.parquet as pq
            return pq.read_schema(path).names
        if ext == ".arrow":
            import pyarrow as pa
            try:
                return pa.ipc.open_stream(path).schema.names
            except pa.ArrowInvalid:
                return pa.ipc.open_file(path).schema.names
        if ext == ".csv":
            with open(path, encoding=ENCODING) as f:
                return next(csv.reader([next((x for x in f if x.strip()), "")]), [])
        return _json_columns(path, rows)
    except NotJson:
        raise
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, UnicodeDecodeError):
            raise
        return None


def _json_columns(path: str, rows):
    """A .json / .jsonl file is read the way `datasets` reads it: one object per line, or,
    when its first line is not a whole JSON value, one document (a list of rows, or an
    object whose keys are the columns) spread over many lines."""
    keys = {}
    with open(path, encoding=ENCODING) as f:
        lines = ((i, x) for i, x in enumerate(f, 1) if x.strip())
        for n, (i, line) in enumerate(itertools.islice(lines, rows)):
            try:
                row = json.loads(line)
            except ValueError as e:
                if n == 0 and line.lstrip()[:1] in "[{":
                    return _document_columns(path, rows)
                raise NotJson(i, getattr(e, "msg", str(e))) from None
            if n == 0 and not isinstance(row, dict):       # a document on one line
                return _document_columns(path, rows)
            if not isinstance(row, dict):
                raise NotJson(i, f"a {type(row).__name__}, not an object of columns")
            keys.update(dict.fromkeys(row))
    return list(keys)


def _document_columns(path: str, rows):
    if rows is not None and os.path.getsize(path) > WHOLE_JSON_BYTES:
        return None
    with open(path, encoding=ENCODING) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise NotJson(getattr(e, "lineno", 1), getattr(e, "msg", str(e))) from None
    if isinstance(doc, dict):
        return list(doc)
    if isinstance(doc, list) and all(isinstance(x, str) for x in doc[:rows]):
        return ["text"]                      # a list of strings: `datasets` names it 'text'
    if isinstance(doc, list) and all(isinstance(x, dict) for x in doc[:rows]):
        return list({k: None for x in doc[:rows] for k in x})
    return None


def text_problem(path: str, column: str, rows=LOOK_ROWS):
    """Why `column` of a JSON-lines file is no text column, from its first `rows` rows: a
    value that is neither a string nor null (the loader refuses such a column), else None."""
    if os.path.splitext(path)[1].lower() not in (".json", ".jsonl"):
        return None
    try:
        with open(path, encoding=ENCODING) as f:
            lines = itertools.islice((x for x in f if x.strip()), rows)
            for n, line in enumerate(lines, 1):
                value = json.loads(line).get(column)
                if value is not None and not isinstance(value, str):
                    return (f"row {n} of {os.path.basename(path)} holds {type(value).__name__} "
                            f"{repr(value)[:40]} in column '{column}', not text; make every "
                            f"row's '{column}' a string (quote numbers), or remove those rows")
    except (OSError, ValueError, AttributeError):   # not JSON lines: the loader will say
        return None
    return None


def _empty(path: str) -> bool:
    """Whether a file holds nothing but white space (read only when it is small)."""
    size = os.path.getsize(path)
    if size > 4096:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def _listed(names: list) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
