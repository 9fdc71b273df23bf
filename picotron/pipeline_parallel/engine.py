"""Run one optimizer step's micro-batches through the pipeline, following a schedule.

The schedule (schedules.py) says, tick by tick, what this rank computes and which activations
and gradients it sends and receives. This file does exactly that and nothing more:

    for each step of this rank:
        compute:      F: input -> chunk's layers -> output (kept for the backward)
                      B: d loss / d output -> backward through the chunk -> d loss / d input
        communicate:  send what was just produced, receive what the neighbours produced,
                      all in one batched exchange (p2p.py)

Shapes: every message is a (B, T, C) tensor: B micro_batch_size, T this rank's share of the
sequence, C hidden size. The first virtual stage reads token ids (B, T); the last turns its
output into the loss, a scalar.

The loss is scaled exactly as on the one-process path (train.py): each micro-batch's mean
cross-entropy is divided by the number of micro-batches before its backward (and multiplied by
the fp16 loss scale, 1 otherwise), so the gradients are those of the mean loss over the global
batch. The last stage returns the sum of the divided losses, i.e. the mean; every other stage
returns 0 (the logging rank is a last stage).

Gradient reductions (data_parallel's buckets) start during this rank's last backward, for the
buckets it completes; the rest, and the tied embedding's sum across the pipeline's two ends,
start in `grads.finish()` (a blocking sum inside a backward would stall this stage before it
sends its gradients on).

`pipeline_forward` is the forward-only pass validation uses: one micro-batch, the stages one
after the other, no schedule.
"""
import functools

import torch

from picotron.pipeline_parallel.p2p import check_spec, exchange, message_spec
from picotron.pipeline_parallel.schedules import rank_steps, schedule_orders, timeline
from picotron.pipeline_parallel.stage import rank_chunks, virtual_stages


@functools.lru_cache(maxsize=None)
def steps_for(engine: str, pp: int, micro_batches: int, v: int, rank: int) -> tuple:
    """This rank's steps; the same every optimizer step, so computed once."""
    return tuple(rank_steps(timeline(schedule_orders(engine, pp, micro_batches, v), v), rank, v))


def forward_step(model, inputs, position_ids, chunk_layers):
    """inputs: token ids (B, T) or hidden states (B, T, C) -> (B, T, C), or the model's
    output (logits) after its last layer. position_ids (B, T): every stage needs them (RoPE)."""
    return model(inputs, position_ids, layers=chunk_layers)


def backward_step(output, grad_output):
    """Backward through one chunk. grad_output is None when output is the (scalar) loss."""
    torch.autograd.backward(output, grad_output)


def run_steps(model, steps, chunks, get_batch, loss_fn, config, pgm, loss_scale=1.0,
              grads=None):
    """Execute this rank's `steps`. chunks[c]: layer keys of chunk c. get_batch(micro) ->
    (inputs, targets, position_ids) on the device; loss_fn(logits, targets) -> mean loss.
    With `grads` (the data-parallel buckets), this rank's last backward runs with
    `grads.sync`, so buckets it completes start their reduction during that backward.
    Returns (sum of the divided losses on the last stage, else 0; the most micro-batch
    activations this rank held at once)."""
    pp, rank, ranks = pgm.pp_size, pgm.pp_rank, pgm.pp_group_ranks
    last_stage = pp * len(chunks) - 1
    accum = config.training.gradient_accumulation_steps
    spec = message_spec(config, pgm)
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    stash = {}      # (chunk, micro) -> (input, output): the activations alive on this rank
    inbox = {}      # (kind, stage, micro) -> a received activation or gradient
    outbox = {}     # (kind, stage, micro) -> a tensor waiting for this step's exchange
    peak = 0
    last_backward = max((i for i, st in enumerate(steps)
                         if st.action is not None and st.action.kind == "B"), default=-1)
    for i, step in enumerate(steps):
        a = step.action
        if grads is not None:
            grads.sync = i == last_backward
        if a is not None:
            s = a.chunk * pp + rank                        # this action's virtual stage
            if a.kind == "F":
                if s == 0:
                    inputs = get_batch(a.micro)[0]                                # (B, T)
                else:      # a leaf, so its .grad is what goes back to the previous stage
                    inputs = inbox.pop(("act", s, a.micro)).requires_grad_()     # (B, T, C)
                output = forward_step(model, inputs, get_batch(a.micro)[2], chunks[a.chunk])
                if s == last_stage:
                    output = loss_fn(output, get_batch(a.micro)[1]) / accum
                    total += output.detach()
                    output = output * loss_scale
                else:
                    outbox[("act", s + 1, a.micro)] = output.detach()
                stash[(a.chunk, a.micro)] = (inputs, output)
                peak = max(peak, len(stash))
            else:
                inputs, output = stash.pop((a.chunk, a.micro))   # freed after this backward
                grad = None if s == last_stage else inbox.pop(("grad", s, a.micro))
                backward_step(output, grad)
                if s > 0:
                    outbox[("grad", s - 1, a.micro)] = inputs.grad
        sends, recvs = [], []
        for m in step.sends:
            tensor = outbox.pop((m.kind, m.stage, m.micro))
            check_spec(tensor, spec, f"{'activation' if m.kind == 'act' else 'gradient'} "
                                     f"sent by stage {rank} (virtual stage {m.stage})")
            sends.append((tensor, ranks[m.dst]))
        for m in step.recvs:
            buffer = torch.empty(spec[0], dtype=spec[1], device=device)
            inbox[(m.kind, m.stage, m.micro)] = buffer
            recvs.append((buffer, ranks[m.src]))
        exchange(sends, recvs, pgm.pp_group)
    assert not (stash or inbox or outbox), "schedule left work undone"
    return total, peak


def pipeline_forward(model, loss_fn, inputs, targets, positions, config, pgm):
    """One micro-batch forward through the pipeline, no backward: the mean loss on the ranks
    of the last virtual stage, None on the others.

    The virtual stages s = 0 .. pp*v-1 run one after the other (validation is rare, so no
    schedule overlaps them): the rank holding stage s (s % pp) receives its input from the
    holder of s - 1, runs its chunk and sends the output on, exactly what a training forward
    sends. Each rank visits its own virtual stages in increasing order, and the stages form
    one chain, so each receive waits for exactly one send."""
    pp, rank, ranks = pgm.pp_size, pgm.pp_rank, pgm.pp_group_ranks
    chunks = rank_chunks(config, rank)
    last = pp * len(chunks) - 1
    (_, T, C), dtype = message_spec(config, pgm)
    x, loss = inputs, None                          # token ids (B, T) on the first stage
    for s in range(rank, last + 1, pp):             # this rank's virtual stages, in order
        if s > 0:
            x = torch.empty((inputs.shape[0], T, C), dtype=dtype, device=inputs.device)
            exchange([], [(x, ranks[(s - 1) % pp])], pgm.pp_group)
        out = forward_step(model, x, positions, chunks[s // pp])
        if s == last:
            loss = loss_fn(out, targets)
        else:
            exchange([(out, ranks[(s + 1) % pp])], [], pgm.pp_group)
    return loss


def pipeline_train_step(model, loss_fn, grads, batches, step, config, pgm, loss_scale):
    """train.py's train_step for pp > 1: all micro-batches of `step` (picotron/data/windows.py
    StepBatches: this rank's samples and cp share, on the device) through the schedule
    `distributed.pp_engine`. Returns the mean loss over the micro-batches on the last stage,
    0 elsewhere."""
    engine, accum = config.distributed.pp_engine, config.training.gradient_accumulation_steps
    steps = steps_for(engine, pgm.pp_size, accum, virtual_stages(config), pgm.pp_rank)
    loss, _ = run_steps(model, steps, rank_chunks(config, pgm.pp_rank),
                        lambda micro: batches.get(step, micro), loss_fn, config, pgm,
                        loss_scale, grads)
    return loss
