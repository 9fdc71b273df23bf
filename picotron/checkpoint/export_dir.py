"""The folder a Hugging Face export writes (export_hf in picotron/checkpoint/hf_io.py), and the rule
for what already lies there.

An export writes `picotron_export.json` beside the model, listing the files it wrote. Then:
- a new or empty folder is written;
- a folder holding an earlier export (its `picotron_export.json`) is rewritten: the files that
  export listed are replaced or, when the new export does not write them (the shards of a
  larger model, another tokenizer's files), removed, so the folder loads as the new model; the
  files it did not list were added by someone else (a model card, notes) and stay as they are,
  and a new file that would replace one of them refuses the export;
- any other non-empty folder (a downloaded model, a run's folder) is refused, untouched.

The export is written into a staging folder inside the target first, and its files move in
only once all of them are written, so an export that fails midway leaves the earlier one whole.
"""
import contextlib
import glob
import json
import os
import shutil
import tempfile
import time

from picotron.config.ranges import unwritable

# A file of its own, not a key in config.json: transformers keeps unknown config keys and
# save_pretrained copies them into every folder the model is saved to, so a key would mark
# folders picotron never wrote; the file also lists exactly which files are picotron's.
MARKER = "picotron_export.json"
STAGING_PREFIX = ".picotron-export-"
STALE_STAGING_S = 86400.0      # older staging folders were left by killed exports: removed


class ExportError(ValueError):
    """An export directory whose files the export would overwrite."""


def _entries(out_dir: str) -> list:
    """What lies in `out_dir`, less the staging folders of exports under way (or killed)."""
    return sorted(n for n in os.listdir(out_dir) if not n.startswith(STAGING_PREFIX))


def earlier_export_files(out_dir: str):
    """The files an earlier export listed in `out_dir`'s marker, or None where there is none
    (or it is not the marker an export writes). Only plain names count: a marker edited to
    name '../x' cannot make an export remove files outside its folder."""
    try:
        with open(os.path.join(out_dir, MARKER)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, list):
        return None
    return {n for n in files if isinstance(n, str) and n == os.path.basename(n)
            and n not in ("", ".", "..", MARKER)}


def check_export_dir(out_dir: str) -> None:
    """Refuse (ExportError) an export directory that is not new, empty or an earlier export."""
    if not out_dir.strip():
        raise ExportError("the export directory is an empty string; give a directory to "
                          "create, e.g. --out tmp/debug-hf")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"the export directory '{out_dir}' is a file; give a directory "
                          f"to create, e.g. tmp/debug-hf")
    problem = unwritable(out_dir)
    if problem:
        raise ExportError(f"cannot write the export directory '{out_dir}': {problem}")
    present = _entries(out_dir) if os.path.isdir(out_dir) else []
    if present and earlier_export_files(out_dir) is None:
        raise ExportError(f"the export directory '{out_dir}' holds files ("
                          f"{', '.join(present[:4])}{', ...' if len(present) > 4 else ''}) "
                          f"but no {MARKER}, which every export since picotron marks its "
                          f"folders writes: a downloaded model, a run, or an export of an "
                          f"earlier picotron, which the export would overwrite; give a new "
                          f"or empty --out, e.g. --out '{out_dir.rstrip(os.sep)}-hf' (or "
                          f"empty that folder if it is an export of yours)")


def _write_marker(folder: str, files) -> None:
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump({"written_by": "picotron export_hf.py", "files": sorted(files)}, f,
                  indent=2)
        f.write("\n")


def _move_in(staging: str, out_dir: str) -> None:
    new = set(os.listdir(staging))
    earlier = earlier_export_files(out_dir) or set()
    theirs = sorted(n for n in new if n not in earlier and os.path.lexists(
        os.path.join(out_dir, n)))
    if theirs:
        raise ExportError(f"the export would replace {', '.join(theirs)} in '{out_dir}', "
                          f"which the earlier export there did not write (someone added "
                          f"them); move them out of the folder, or give a new or empty --out")
    # Listed first as ours, so that an export killed while moving leaves a folder the next
    # export may rewrite, not one it must refuse as someone else's.
    _write_marker(out_dir, earlier | new)
    for name in new:
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    for name in earlier - new:
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    _write_marker(out_dir, new)


@contextlib.contextmanager
def export_staging(out_dir: str):
    """Yield a folder to write the export into; when the block ends without an error, its
    files replace the earlier export in `out_dir` (the module's rule). The staging folder is
    removed either way."""
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, STAGING_PREFIX + "*")):
        if time.time() - os.path.getmtime(old) > STALE_STAGING_S:   # an export killed there
            shutil.rmtree(old, ignore_errors=True)
    # inside out_dir, so on its disk: the files move in by a rename, not a copy
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
    try:
        yield staging
        _move_in(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
