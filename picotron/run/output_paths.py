"""The folders and files a run writes, checked once the run directory is known and before
anything is built, so that a path in the way is refused at start: not after minutes of
building or hours of tokenizing, nor at the first record or the first save.

Folders (each an existing folder, or creatable in the nearest folder above it that exists,
with no file in the way; the run directory is made here, since permissions do not tell all):
- the run directory (logging.run_dir, else the config file's folder): metrics, launches;
- checkpoint.save_dir, when checkpoints are written;
- <run dir>/tensorboard, with logging.tensorboard;
- the token cache (dataset.cache_dir, else the user's cache folder), when the dataset is
  tokenized; only a file in its way is refused here, since a cache the user may read but not
  write still serves the entries it holds (a miss there is refused before the tokenizing).

Files (a file, or nothing yet; a folder by that name would stop the run when it is written):
<run dir>/metrics.jsonl and launches.jsonl, and <save_dir>/latest (which a resume from
"latest" reads and every save rewrites).
"""
import os

from picotron.config.ranges import not_a_folder, unwritable
from picotron.errors import ConfigError
from picotron.data.token_cache import cache_dir


def check_output_dirs(config, run_dir: str) -> None:
    """Refuse a run whose outputs cannot be written, naming every path in the way."""
    c = config.checkpoint
    save_root = os.path.join(run_dir, c.save_dir)
    saves = bool(c.save_frequency or c.save_final)
    folders = [("the run directory (logging.run_dir, else the config file's folder)", run_dir)]
    if saves:
        folders.append(("checkpoint.save_dir", save_root))
    if config.logging.tensorboard:
        folders.append(("logging.tensorboard's folder", os.path.join(run_dir, "tensorboard")))
    problems = [f"{what} '{folder}': {problem}" for what, folder in folders
                if (problem := unwritable(folder))]
    if config.dataset.name != "synthetic" and not config.dataset.raw_bytes:    # tokenized
        where = "dataset.cache_dir" if config.dataset.cache_dir else (
            "the token cache (dataset.cache_dir is null: the user's cache folder)")
        problem = not_a_folder(cache_dir(config, run_dir))
        if problem:
            problems.append(f"{where} '{cache_dir(config, run_dir)}': {problem}")
    files = [os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "launches.jsonl")]
    if saves or c.load_path == "latest":
        files.append(os.path.join(save_root, "latest"))
    problems += [f"'{path}' is a folder where the run writes a file of that name; remove it or "
                 f"move it away" + (" (the checkpoints beside it are not touched)"
                                    if path.endswith("latest") else "")
                 for path in files if os.path.isdir(path)]
    if not problems:     # made now: permissions do not tell all (/proc, a read-only mount)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            problems.append(f"the run directory '{run_dir}' cannot be made "
                            f"({e.strerror or type(e).__name__}); choose another folder")
    if problems:
        raise ConfigError("cannot write the run's outputs:\n  - " + "\n  - ".join(problems))
