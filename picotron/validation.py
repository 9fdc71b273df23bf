"""Validation loss on the held-out windows, averaged over every token of the set."""
import torch
import torch.distributed as dist

from picotron.context_parallel import shard_sequence
from picotron.pipeline_parallel.engine import pipeline_forward


@torch.no_grad()
def validation_loss(model, loss_fn, val_data, config, pgm, device) -> float:
    """Mean next-token cross-entropy over all `val_samples` held-out windows.

    DP rank r evaluates windows r, r + dp, r + 2*dp, ... in micro-batches; the summed losses
    and token counts are added over the DP group, so the result does not depend on dp (nor on
    how the windows split into micro-batches). Under context parallelism each rank scores its
    zigzag share of every window. Under pipeline parallelism the windows go through the stages
    (pipeline_forward) and the last stage's sums are shared with the pipeline group."""
    count = getattr(val_data, "num_windows", config.dataset.val_samples)
    mine = list(range(pgm.dp_rank, count, pgm.dp_size))
    mbs = config.training.micro_batch_size
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)       # [sum of losses, tokens]
    for i in range(0, len(mine), mbs):
        windows = torch.stack([val_data.window(j) for j in mine[i:i + mbs]]).to(device)
        # this CP rank's share of the tokens (all of them when cp_size is 1)
        inputs, targets, positions = shard_sequence(windows[:, :-1], windows[:, 1:],
                                                    pgm.cp_rank, pgm.cp_size)
        if pgm.pp_size > 1:
            loss = pipeline_forward(model, loss_fn, inputs, targets, positions, config, pgm)
            if loss is None:        # not the last stage: its share of the sums is zero
                continue
        else:
            loss = loss_fn(model(inputs, positions), targets)
        # loss_fn is the token mean (vocab-parallel under TP): times the count, a sum
        total += torch.stack([loss.double() * targets.numel(), torch.tensor(
            targets.numel(), dtype=torch.float64, device=device)])
    if pgm.cp_dp_size > 1:          # DP ranks read different windows, CP ranks other tokens
        dist.all_reduce(total, group=pgm.cp_dp_group)
    if pgm.pp_size > 1:             # only the last stage holds the sums
        dist.all_reduce(total, group=pgm.pp_group)
    model.train(was_training)
    return (total[0] / total[1]).item()
