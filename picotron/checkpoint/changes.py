"""Would resuming this checkpoint with this config change the run? Refuse, or record why not.

A resume continues the run that wrote the checkpoint: the same model, the same samples in
the same order, the same batches. A config that differs in a setting that changes those is
another run under the old name, so it is refused, naming each setting and the fix:
- the model's shape: the weights do not fit, never accepted (start a new run);
- the model's `rope_theta` and `rms_norm_eps`: the same weights would compute another
  function (a context extension may mean it): accepted only when listed, as below;
- `training.seed` (the data order), `training.seq_length` and the dataset settings (which
  windows exist), the global batch (which samples each step takes), and the number of
  windows the dataset holds or, as many, their tokens (`dataset.contents`, the sha256 of the
  training stream: the same settings reading changed files): accepted only when
  listed in `checkpoint.allow_changes`. An accepted change is recorded in the state of every
  later checkpoint (`accepted_changes`: from which checkpoint, at which step, old -> new), so
  the run's history says where it stopped being one run.
Another precision (`training.dtype`, `training.master_weights`: a bf16 fine-tune of an fp32 run)
is accepted without being listed, since the weights and the data are the same, but it changes
the arithmetic of every later step: it is recorded in the same history, and said.
A new learning-rate schedule (more steps, another peak) is neither: the user asked for it, but
it moves the lr at once (a longer run stretches the cosine, so the lr rises again), so the
resume line says so (`schedule_change`).
"""
import os

from picotron.checkpoint.verify import FUNCTION_SETTINGS, PRECISION_FIELDS, SAVED_SETTINGS
from picotron.checkpoint.shards import SharedCheckpointError
from picotron.utils import SCHEDULE_SETTINGS, lr_at

# Model fields that fix the shapes of the weights; dataset fields that pick the windows.
SHAPE_FIELDS = tuple(k[6:] for k in SAVED_SETTINGS if k.startswith("model."))
DATASET_FIELDS = tuple(k[8:] for k in SAVED_SETTINGS if k.startswith("dataset."))


def _batch(config) -> str:
    t = config.training
    return (f"{config.global_batch_size} ({t.micro_batch_size} x "
            f"{t.gradient_accumulation_steps} x {config.distributed.dp_size})")


def check_model_shape(saved, config, directory: str) -> None:
    diffs = [f"model.{k}: checkpoint {getattr(saved.model, k)!r}, this config "
             f"{getattr(config.model, k)!r}" for k in SHAPE_FIELDS
             if getattr(saved.model, k) != getattr(config.model, k)]
    if diffs:
        raise SharedCheckpointError(f"checkpoint {directory} was written by a model of "
                                    f"another shape ({'; '.join(diffs)}); resume with the "
                                    f"same model settings, or start a new run")


def _same(old, new) -> bool:
    """Equal settings; a path is the same written with '~' (as a checkpoint from before '~'
    was expanded at load saved it) or expanded."""
    return old == new or (isinstance(old, str) and isinstance(new, str)
                          and os.path.expanduser(old) == os.path.expanduser(new))


def optional_diffs(saved, config, names) -> dict:
    """{'section.key': (checkpoint's value, this config's)} for the `names` that differ, among
    settings a checkpoint may lack (None: it did not save it, so nothing is compared)."""
    diffs = {}
    for name in names:
        section, key = name.split(".")
        old, new = (getattr(getattr(c, section), key) for c in (saved, config))
        if old is not None and old != new:
            diffs[name] = (old, new)
    return diffs


def run_changes(saved, config, saved_windows, windows, saved_contents=None,
                contents=None) -> dict:
    """{setting: (checkpoint's value, this config's)} for every run-changing difference.
    `*_contents`: the token stream's sha256 (None: not known, as for synthetic data)."""
    diffs = optional_diffs(saved, config, FUNCTION_SETTINGS)
    for key in ("seed", "seq_length"):
        if getattr(saved.training, key) != getattr(config.training, key):
            diffs[f"training.{key}"] = (getattr(saved.training, key),
                                        getattr(config.training, key))
    for key in DATASET_FIELDS:
        if not _same(getattr(saved.dataset, key), getattr(config.dataset, key)):
            diffs[f"dataset.{key}"] = (getattr(saved.dataset, key), getattr(config.dataset, key))
    if saved.global_batch_size != config.global_batch_size:
        # mbs x grad_acc x dp: a new layout may split the same global batch differently
        diffs["global_batch_size"] = (_batch(saved), _batch(config))
    explained = {f"dataset.{k}" for k in DATASET_FIELDS} | {"training.seq_length"}
    if saved_windows != windows and not diffs.keys() & explained:
        diffs["dataset.num_windows"] = (saved_windows, windows)   # same settings, other data
    elif None not in (saved_contents, contents) and saved_contents != contents and not (
            diffs.keys() & explained):           # as many windows, other tokens in them
        diffs["dataset.contents"] = (saved_contents[:12], contents[:12])
    return diffs


WHY = {"training.seed": "the data order follows the seed",
       "model.rope_theta": "the trained weights would see other rotary frequencies",
       "model.rms_norm_eps": "the trained weights would see other normalised activations",
       "global_batch_size": "each step would take other samples, skipping or repeating some "
                            "(micro_batch_size x gradient_accumulation_steps x dp_size)",
       "dataset.num_windows": "the same dataset settings now read other data (did the files "
                              "change?)",
       "dataset.contents": "the same dataset settings now read other tokens, as many windows "
                           "of them (were the files edited, or the tokenizer's files?)"}


def schedule_change(saved, config, step: int):
    """Words for the resume line when this config's schedule differs from the checkpoint's
    (`saved`): the lr each would use at the next step (once, where they print the same), and
    the settings that differ; None
    when the schedule is the same, or when no step is left to train."""
    old, new = saved.training, config.training
    if any(getattr(old, k) is None for k in SCHEDULE_SETTINGS):    # a checkpoint without one
        return None
    changed = [k for k in SCHEDULE_SETTINGS if getattr(old, k) != getattr(new, k)]
    if not changed or step >= new.total_train_steps:
        return None

    def settings(t):          # "200 steps", "220 steps, learning_rate 1.00e-04"
        return ", ".join(SCHEDULE_SETTINGS[k].format(getattr(t, k)) for k in changed)
    before, after = f"{lr_at(step + 1, old):.2e}", f"{lr_at(step + 1, new):.2e}"
    if before == after:       # in the warm-up, say: the schedules part later
        return (f"the schedule changes, from the checkpoint's {settings(old)} to this config's "
                f"{settings(new)}; lr at step {step + 1} is {after} under both")
    return (f"the schedule changes: lr at step {step + 1} would be {before} under the "
            f"checkpoint's ({settings(old)}), is {after} under this config ({settings(new)})")


def check_resume(state: dict, saved, config, directory: str, windows, contents=None) -> list:
    """The accepted changes to record in the next checkpoints: the checkpoint's history plus,
    if this resume changes the run by settings `checkpoint.allow_changes` lists, one record.
    Anything else that would change the run is a (Shared)CheckpointError."""
    check_model_shape(saved, config, directory)
    diffs = run_changes(saved, config, state["data"]["num_windows"], windows,
                        state["data"].get("contents"), contents)
    allowed = set(config.checkpoint.allow_changes)
    refused = {k: v for k, v in diffs.items() if k not in allowed}
    if refused:
        lines = "; ".join(f"{k}: checkpoint {a!r}, this config {b!r}"
                          + (f" ({WHY[k]})" if k in WHY else "") for k, (a, b) in
                          refused.items())
        raise SharedCheckpointError(f"resuming checkpoint {directory} would change the run: "
                                    f"{lines}. Restore these settings to continue the same "
                                    f"run, or accept the change (recorded in the next "
                                    f"checkpoints) with checkpoint.allow_changes: "
                                    f"{sorted(refused)}")
    history = list(state.get("accepted_changes") or [])
    diffs.update(optional_diffs(saved, config, PRECISION_FIELDS))   # accepted unlisted
    if diffs:
        history.append({"from": directory, "step": state["step"],
                        "tokens_seen": state["tokens_seen"],
                        "changes": {k: list(v) for k, v in diffs.items()}})
    return history
