"""Which checkpoint a run resumes from, and what a run directory already holds.

`find_checkpoint` turns checkpoint.load_path into one verified step directory: a path names
one (refused by name if anything in it is wrong), "latest" the last one written (the `latest`
file's), or, if that one is damaged, the newest valid one by step, each skipped one named.
Verification is collective: every rank hashes a share of the files and all of them get the
union of the problems (`verified`), so the ranks decide together and the errors raised here
are the same on every rank (SharedCheckpointError: said once).
`existing_run` and `check_new_run` keep a new run from overwriting an earlier one's outputs;
`checkpoint_to_read` is what generate.py and export_hf.py read.
"""
import os
import re
import sys

import torch.distributed as dist

from picotron.checkpoint.verify import (STATE_FILE, directory_problems, latest_written, step_names)
from picotron.errors import ConfigError
from picotron.checkpoint.shards import SharedCheckpointError

UNFINISHED_SAVE = re.compile(r"step_\d+\.tmp")    # a save's folder until its final rename


def complete_checkpoints(save_root: str) -> list:
    """Checkpoint directories under save_root that hold a state.json, oldest first."""
    return [d for d in _step_dirs(save_root) if os.path.isfile(os.path.join(d, "state.json"))]


def _step_dirs(save_root: str) -> list:
    return [os.path.join(save_root, d) for d in step_names(save_root)]


def verified(directory: str, pgm=None) -> tuple:
    """(state, saved config, problems) of a whole check. Every rank hashes its share of the
    files, and all of them get the union of the problems, so they decide together."""
    rank, world = (0, 1) if pgm is None else (dist.get_rank(), dist.get_world_size())
    state, saved, problems = directory_problems(directory, rank, world)
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = list(dict.fromkeys(p for part in everyone for p in part))
    return state, saved, problems


def find_checkpoint(load_path: str, save_root: str, run_dir: str, pgm=None) -> tuple:
    """(directory, state, saved config) to resume from; (None, None, None) for "latest" when
    nothing was saved yet. "latest" is the last checkpoint written (the `latest` file's) if it
    is complete and valid, else the newest one by step that is; each one skipped is named with
    the reason (a warning on stderr). A checkpoint named explicitly is refused if anything is
    wrong with it, and so is a folder of them or a run directory, naming one to give instead.
    Collective when `pgm` is given."""
    if load_path != "latest":
        path = load_path if os.path.isabs(load_path) else os.path.join(run_dir, load_path)
        if not os.path.isdir(path):
            found = [os.path.relpath(d, run_dir) for d in complete_checkpoints(save_root)]
            raise SharedCheckpointError(f"checkpoint.load_path='{load_path}' ({path}) is not "
                                        f"a directory; a relative path starts at the run "
                                        f"directory, which holds {found or 'no checkpoint'}; "
                                        f"or use 'latest'")
        inside = step_names(path)
        if inside and not os.path.exists(os.path.join(path, "state.json")):
            raise SharedCheckpointError(f"checkpoint.load_path='{load_path}' is a folder of "
                                        f"checkpoints ({len(inside)} of them); name one of "
                                        f"them (e.g. {os.path.join(load_path, inside[-1])}), "
                                        f"or use 'latest' for this run's own")
        nested = [os.path.join(load_path, d, step_names(os.path.join(path, d))[-1])
                  for d in sorted(os.listdir(path)) if step_names(os.path.join(path, d))]
        if not inside and nested and not os.path.exists(os.path.join(path, STATE_FILE)):
            raise SharedCheckpointError(f"checkpoint.load_path='{load_path}' is a run "
                                        f"directory, not a checkpoint; name one of its "
                                        f"checkpoints (e.g. {nested[0]}), or resume that run with "
                                        f"its own config.json and load_path=latest")
        state, saved, problems = verified(path, pgm)
        if problems:
            raise SharedCheckpointError("; ".join(problems))
        return path, state, saved
    skipped, candidates = [], _step_dirs(save_root)[::-1]
    written = latest_written(save_root)
    for i, candidate in enumerate(candidates):    # after a resume from an older checkpoint,
        if os.path.basename(candidate) == written:  # the steps above it are another history
            candidates.insert(0, candidates.pop(i))
            break
    else:       # damaged, or naming a checkpoint deleted by hand: said if others are resumed
        if written is not None and candidates:
            skipped.append(f"the `latest` file's {written[:40]!r} (no such checkpoint here)")
        elif candidates:    # every save writes it last: deleted by hand, or never finished
            skipped.append(f"the `latest` file (there is none in {save_root}: the newest "
                           f"valid checkpoint is taken instead, which may not be the last "
                           f"one written)")
    for candidate in candidates:
        state, saved, problems = verified(candidate, pgm)
        if not problems:
            if skipped and (pgm is None or pgm.global_rank == 0):
                print("warning: checkpoint.load_path=latest skipped " + "; ".join(skipped)
                      + f"; resuming from {candidate}", file=sys.stderr, flush=True)
            return candidate, state, saved
        skipped.append(f"{os.path.basename(candidate)} ({'; '.join(problems)})")
    if skipped:      # checkpoints exist but none can be trusted: never start over silently
        raise SharedCheckpointError(f"no valid checkpoint under {save_root}: "
                                    f"{'; '.join(skipped)}; repair or remove them, or start a "
                                    f"new run in another directory")
    return None, None, None


def existing_run(run_dir: str, save_root: str):
    """What a run directory already holds of an earlier run (its complete checkpoints, a
    metrics.jsonl with records), or None: a new run there would overwrite them."""
    held = [os.path.basename(d) for d in complete_checkpoints(save_root)]
    what = [f"checkpoints {held[0]} to {held[-1]}" if len(held) > 1 else f"checkpoint {held[0]}"
            ] if held else []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        what.append("metrics.jsonl")
    return ", ".join(what) or None


def check_new_run(run_dir: str, save_root: str) -> None:
    """Refuse to start a run (checkpoint.load_path null) over an earlier one's outputs."""
    held = existing_run(run_dir, save_root)
    if held:
        raise ConfigError(f"the run directory '{run_dir}' already holds a run ({held}), which "
                          f"a new run would overwrite; resume it with --set "
                          f"checkpoint.load_path=latest, or start the new run in another "
                          f"directory (create_config.py --exp_name OTHER, or --set "
                          f"logging.run_dir=OTHER), or move those files away")


def resolve_checkpoint(load_path: str, save_root: str, run_dir: str):
    """The directory find_checkpoint picks (one process), or None."""
    return find_checkpoint(load_path, save_root, run_dir)[0]


def unfinished_saves(save_root: str) -> list:
    """The step_N.tmp directory names under save_root: saves killed before their rename to
    step_N (picotron/checkpoint/write.py), so never a checkpoint, whatever they hold."""
    if not os.path.isdir(save_root):
        return []
    return sorted(d for d in os.listdir(save_root) if UNFINISHED_SAVE.fullmatch(d))


def _unfinished_save_error(path: str) -> SharedCheckpointError:
    """`path`, a step_N.tmp directory, named as what it is, with the checkpoints beside it."""
    parent = os.path.dirname(os.path.normpath(path))
    complete = complete_checkpoints(parent or ".")
    if complete:
        newest = complete[-1] + (f", the newest of {len(complete)}" if len(complete) > 1 else "")
        fix = f"give a complete checkpoint beside it instead: {newest}"
    else:
        fix = "there is no complete checkpoint beside it; resume the run to write one"
    return SharedCheckpointError(f"'{path}' is an unfinished save (its run was killed while "
                                 f"writing it), not a checkpoint; {fix}")


def checkpoint_to_read(path: str) -> str:
    """The verified step directory that `path` names for generate.py and export_hf.py: a step_*
    directory itself (refused if any file is missing, unlisted or damaged), or a checkpoints
    folder's latest valid checkpoint (bad newer ones skipped and named)."""
    if UNFINISHED_SAVE.fullmatch(os.path.basename(os.path.normpath(path))):
        raise _unfinished_save_error(path)
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return find_checkpoint(os.path.abspath(path), path, ".")[0]
    found = resolve_checkpoint("latest", path, ".")
    folders = [os.path.join(path, d) for d in sorted(os.listdir(path))
               if step_names(os.path.join(path, d))] if os.path.isdir(path) else []
    if found is None and folders:                     # a run directory: its checkpoints
        raise SharedCheckpointError(f"'{path}' is a run directory, not a checkpoint; give "
                                    f"its checkpoints folder ({folders[0]}) or one of them")
    unfinished = unfinished_saves(path)
    if found is None and unfinished:
        raise SharedCheckpointError(f"'{path}' holds no complete checkpoint, only unfinished "
                                    f"saves ({', '.join(unfinished)}: their run was killed "
                                    f"while writing them); resume the run to write one")
    if found is None:
        raise SharedCheckpointError(f"'{path}' is neither a checkpoint (a step_* directory "
                                    f"with a {STATE_FILE}) nor a folder of them; give e.g. "
                                    f"tmp/debug/checkpoints or "
                                    f"tmp/debug/checkpoints/step_000200")
    return found
