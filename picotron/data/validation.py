"""Validation loss on the held-out windows, averaged over every token of the set; in bits per
byte too when the tokens are bytes (the unit byte-level results such as enwik8's are given in)."""
import math

import torch
import torch.distributed as dist

from picotron.context_parallel import shard_sequence
from picotron.errors import DataError
from picotron.pipeline_parallel.engine import pipeline_forward
from picotron.data.tokenizer import is_byte_tokenizer, tokenizer_source


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
    rounds = -(-len(mine) // mbs)
    if config.distributed.zero_stage == 3:    # every forward gathers parameters over cp_dp:
        rounds = -(-len(range(0, count, pgm.dp_size)) // mbs)     # as many as DP rank 0's
    for i in range(0, rounds * mbs, mbs):
        scored = mine[i:i + mbs]           # empty: a rank with fewer windows runs window 0
        windows = torch.stack([val_data.window(j) for j in scored or [0]]).to(device)
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
        if scored:
            total += torch.stack([loss.double() * targets.numel(), torch.tensor(
                targets.numel(), dtype=torch.float64, device=device)])
    if pgm.cp_dp_size > 1:          # DP ranks read different windows, CP ranks other tokens
        dist.all_reduce(total, group=pgm.cp_dp_group)
    if pgm.pp_size > 1:             # only the last stage holds the sums
        dist.all_reduce(total, group=pgm.pp_group)
    model.train(was_training)
    return (total[0] / total[1]).item()


def byte_level(config) -> bool:
    """Whether every token is one byte of text: the embedded corpus, a raw byte range, or a
    dataset under the byte tokenizer (its EOS between documents counts as a byte too)."""
    if config.dataset.name == "synthetic":
        return False
    try:                       # "byte" for the embedded corpus and a raw byte range
        source = tokenizer_source(config)
    except DataError:          # no tokenizer can be named: the data step says why
        return False
    return source == "byte" or is_byte_tokenizer(source)   # or one exported from bytes


def validation_record(step: int, val_loss: float, config) -> dict:
    """The metrics.jsonl object of a validation: step and val_loss (nats per token), and
    val_bits_per_byte = val_loss / ln 2 when tokens are bytes."""
    record = {"step": step, "val_loss": val_loss}
    if byte_level(config):
        record["val_bits_per_byte"] = val_loss / math.log(2)
    return record


def validation_line(record: dict) -> str:
    line = f"step {record['step']:>5} | val loss {record['val_loss']:.4f}"
    if "val_bits_per_byte" in record:
        line += f" | {record['val_bits_per_byte']:.4f} bits per byte"
    return line
