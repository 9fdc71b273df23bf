"""Worker for test_fp8_delayed.py: training.fp8="tensorwise_delayed" at dp2 on 2 gloo ranks.

argv: the dp2 config, the output file, STEPS, a checkpoint folder, then the ZeRO-3 dp2, tp2,
pp2, cp2 and cp2 + training.compile configs (compiled with aot_eager: the traced ops as they
are, so that the numbers stay eager's). Trains the dp2 config twice through train.py's build
and step: as the recipe is (saving a checkpoint after step 2), and as a control whose amax
roll skips the data-parallel group (each rank's scales from its own micro-batches only); then
the others, a tp2 control whose roll skips the tensor-parallel group, and a cp2 control whose
first step scales each rank's chunk of the sequence by its own amax. FP8 is set after loading: the
config refuses FP8 on CPU (no FP8 tensor cores), and the math is the GPU's. Rank 0 saves,
per run, the losses, the delayed amaxes after each step, and the final weights (under tp
or pp put together by a checkpoint). `run` also
resumes a checkpoint (the test calls it in one process)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
import train  # noqa: E402
from picotron.data.windows import StepBatches, build_train_val  # noqa: E402


def run(path, steps, skip=None, save_to=None, resume=None):
    """{"losses", "amaxes" (one {site: A_s} per step), "weights"} of the steps up to `steps`;
    `skip`: "dp" or "tp", a control whose roll leaves out that group, or "cp", one whose
    calibrating casts scale by the rank's chunk of the sequence alone; `save_to`: a
    checkpoint folder, saved after step 2; `resume`: a checkpoint to start from (the result
    then has "loaded": the amaxes the ledger took from it)."""
    from checkpoint_helpers import step_state
    from picotron.checkpoint.checkpoint import load_checkpoint, load_full_weights, save_checkpoint
    config, pgm, device = train.setup(path)
    config.training.fp8 = "tensorwise_delayed"
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    ledger, first, out = model.fp8_ledger, 0, {}
    if skip == "cp":                    # the first step's casts scale by the chunk's amax
        ledger.sequence_group = None
    elif skip is not None:
        left_out = pgm.cp_dp_group if skip == "dp" else pgm.tp_group
        ledger.groups = [g for g in ledger.groups if g is not left_out]
    if resume is not None:
        first = load_checkpoint(resume, model, optimizer, pgm, config)["step"]
        out["loaded"] = ledger.state()
    batches = StepBatches(build_train_val(config, os.path.dirname(path))[0], config, pgm,
                          device)
    losses, amaxes = [], []
    for step in range(first, steps):
        values = train.queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm,
                                  device)
        losses.append(values.read()["loss"])
        if save_to is not None and step + 1 == 2:
            save_checkpoint(model, optimizer, pgm, config, save_to, 2, step_state(config, 2))
        ledger.before_forward()         # the roll the next step's first forward would run
        amaxes.append(every_stage(ledger.state()) if pgm.pp_size > 1 else ledger.state())
    if pgm.pp_size > 1:                 # the loss is the last stage's
        losses = every_stage(losses)
    if pgm.tp_size == 1 and pgm.pp_size == 1:
        with grads.full_parameters():               # ZeRO-3 holds only shards between steps
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:       # parts of them on each rank: put together by a layout-free checkpoint
        final = save_checkpoint(model, optimizer, pgm, config,
                                os.path.join(os.path.dirname(path), "final"), steps,
                                step_state(config, steps))
        weights = load_full_weights(final)
    return {"losses": losses, "amaxes": amaxes, "weights": weights, **out}


def every_stage(mine):
    """Under pp: {site: A_s} of every stage's sites (each rank's ledger holds its layers'),
    or the last stage's losses."""
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    if isinstance(mine, list):
        return parts[-1]
    return {site: a for part in parts for site, a in part.items()}


def main(path, out, steps, save_to, *others):
    runs = {"delayed": run(path, steps, save_to=save_to),
            "control": run(path, steps, skip="dp")}
    real_compile = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: real_compile(self, **kw, backend="aot_eager")
    runs.update({name: run(other, steps) for name, other in zip(
        ("zero3", "tp2", "pp2", "cp2", "cp2 compile"), others)})
    runs["tp2 control"] = run(others[1], 1, skip="tp")
    runs["cp2 control"] = run(others[3], 1, skip="cp")
    if torch.distributed.get_rank() == 0:
        torch.save(runs, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
