"""Validation loss on the held-out windows, averaged over every token of the set."""
import torch
import torch.distributed as dist


@torch.no_grad()
def validation_loss(model, loss_fn, val_data, config, pgm, device) -> float:
    """Mean next-token cross-entropy over all `val_samples` held-out windows.

    DP rank r evaluates windows r, r + dp, r + 2*dp, ... in micro-batches; the summed losses
    and token counts are added over the DP group, so the result does not depend on dp (nor on
    how the windows split into micro-batches). Plain forward: a pipeline or context-parallel
    forward would replace `model(inputs)` here."""
    count = getattr(val_data, "num_windows", config.dataset.val_samples)
    mine = list(range(pgm.dp_rank, count, pgm.dp_size))
    mbs = config.training.micro_batch_size
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)       # [sum of losses, tokens]
    for i in range(0, len(mine), mbs):
        windows = torch.stack([val_data.window(j) for j in mine[i:i + mbs]]).to(device)
        logits = model(windows[:, :-1])                                  # (B, T, V)
        # loss_fn is the token mean (vocab-parallel under TP): times the count, a sum
        loss = loss_fn(logits, windows[:, 1:]) * windows[:, 1:].numel()
        total += torch.stack([loss.double(), torch.tensor(windows[:, 1:].numel(),
                                                         dtype=torch.float64, device=device)])
    if pgm.dp_size > 1:
        dist.all_reduce(total, group=pgm.dp_group)
    model.train(was_training)
    return (total[0] / total[1]).item()
