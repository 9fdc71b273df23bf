"""Pipeline schedules as data: the order of work on each rank, then the clock that runs it.

A schedule is, for every pipeline rank, a list of `Action`s: run the forward ("F") or the
backward ("B") of one micro-batch through one of this rank's model chunks. Everything here is
pure Python (no tensors, no processes), so the tests can read the schedules directly: count
the activations a stage keeps alive, or the idle slots of the pipeline.

Virtual stages. The model's layers are cut into S = pp * v consecutive pieces ("virtual
stages"); rank r holds pieces r, r + pp, r + 2*pp, ... as its chunks 0, 1, ..., v-1. Without
interleaving v = 1 and a chunk is simply the rank's stage. Virtual stage s = chunk * pp + rank
sends its activations to stage s + 1 (on rank (r + 1) % pp) and its input gradients to s - 1.

    pp = 2, v = 2, 8 layers:   rank 0 holds layers [0 1] and [4 5],  rank 1 [2 3] and [6 7]

`timeline` turns the per-rank orders into ticks: at each tick a rank runs at most one action,
as soon as what it needs has arrived (a message sent at tick t can be used from tick t + 1).
`rank_steps` then lists, for one rank, what to compute and what to send and receive after each
tick. Sends and receives of the same tick are issued together, so they always pair up, and no
rank can wait on a tick another rank has not reached. The price of this simplicity: a rank
waits for a message at the tick it is sent even if it only needs it later, which costs a
little when stages run at different speeds.
"""
from collections import namedtuple

# kind "F" (forward) or "B" (backward) of micro-batch `micro` through this rank's chunk `chunk`.
Action = namedtuple("Action", "kind chunk micro")
# An activation ("act") or gradient ("grad") for virtual stage `stage`, from rank src to dst
# (pipeline ranks, 0..pp-1).
Message = namedtuple("Message", "kind stage micro src dst")
# What one rank does at one tick: compute `action` (or None), then exchange sends and recvs.
Step = namedtuple("Step", "tick action sends recvs")


def afab(pp: int, rank: int, micro_batches: int, v: int = 1) -> list:
    """All-forward-all-backward (GPipe, Huang et al. 2019).

    Warm-up: every micro-batch's forward, so all of their activations are alive at once.
    Cool-down: every backward. There is no steady state."""
    warmup = [Action("F", 0, m) for m in range(micro_batches)]
    cooldown = [Action("B", 0, m) for m in range(micro_batches)]
    return warmup + cooldown


def one_f_one_b(pp: int, rank: int, micro_batches: int, v: int = 1) -> list:
    """1F1B, the PipeDream-Flush schedule (Narayanan et al. 2021).

    Warm-up: rank r runs pp - r - 1 forwards, just enough to fill the pipeline behind it.
    Steady state: one forward, then one backward (of the oldest micro-batch still alive), so a
    rank never holds more than pp - r micro-batches of activations, instead of all of them.
    Cool-down: the backwards left over."""
    warmup = min(pp - rank - 1, micro_batches)
    order = [Action("F", 0, m) for m in range(warmup)]                          # warm-up
    for i in range(micro_batches - warmup):                                     # steady state
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    order += [Action("B", 0, m) for m in range(micro_batches - warmup, micro_batches)]  # cool-down
    return order


def interleaved(pp: int, rank: int, micro_batches: int, v: int) -> list:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021, section 2.2).

    Micro-batches travel in groups of pp: a rank runs the forwards of micro-batches
    0..pp-1 on chunk 0, then the same group on chunk 1, ..., then the next group. Backwards
    visit the chunks in the opposite order. With chunks v times smaller, the pipeline fills
    and drains v times faster: the bubble shrinks by v for the same micro-batches.

    Warm-up: (pp - r - 1) * 2 + (v - 1) * pp forwards. Rank r's first backward is micro-batch
    0's on its last chunk. It comes after the (v - 1) * pp forwards of the group's earlier
    chunks, and after micro-batch 0 went on through the pp - r - 1 later ranks and its
    gradient came back through them: 2 (pp - r - 1) transfers, a chunk's work each, which
    the rank fills with forwards of later micro-batches instead of waiting (plain 1F1B has
    no other chunk to run then, so it waits: that is the bubble interleaving shrinks).
    Steady state: one forward, one backward. Cool-down: the remaining backwards."""
    total = micro_batches * v

    def action(kind, k):            # the k-th forward (or backward) of this rank
        group, within = divmod(k, pp * v)
        chunk = within // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk, group * pp + within % pp)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [action("F", k) for k in range(warmup)]                             # warm-up
    for i in range(total - warmup):                                             # steady state
        order += [action("F", warmup + i), action("B", i)]
    order += [action("B", k) for k in range(total - warmup, total)]             # cool-down
    return order


SCHEDULES = {"afab": afab, "1f1b": one_f_one_b, "interleaved": interleaved}


def schedule_orders(engine: str, pp: int, micro_batches: int, v: int = 1) -> list:
    """orders[r]: rank r's list of Actions under `engine`."""
    return [SCHEDULES[engine](pp, r, micro_batches, v) for r in range(pp)]


def stage_of(action: Action, rank: int, pp: int) -> int:
    return action.chunk * pp + rank


def _needs(action: Action, rank: int, pp: int, v: int):
    """The action that must have finished (anywhere) before `action` can start, as
    (kind, stage, micro), or None. The order on the rank itself takes care of the rest
    (a backward comes after its own forward)."""
    s, last = stage_of(action, rank, pp), pp * v - 1
    if action.kind == "F":
        return None if s == 0 else ("F", s - 1, action.micro)
    return None if s == last else ("B", s + 1, action.micro)


def timeline(orders: list, v: int = 1) -> list:
    """ticks[t][r]: the Action rank r runs at tick t, or None (an idle slot).

    Every action takes one tick, and starts at the first tick after what it needs was
    computed. Raises if the orders deadlock (two ranks each waiting for the other)."""
    pp = len(orders)
    done_at = {}                                   # (kind, stage, micro) -> tick finished
    position = [0] * pp
    ticks = []
    while any(position[r] < len(orders[r]) for r in range(pp)):
        t, row = len(ticks), [None] * pp
        for r in range(pp):
            if position[r] == len(orders[r]):
                continue
            a = orders[r][position[r]]
            need = _needs(a, r, pp, v)
            if need is None or done_at.get(need, t) < t:
                row[r] = a
        if not any(row):
            waiting = [orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])]
            raise RuntimeError(f"schedule deadlock at tick {t}: every rank waits ({waiting})")
        for r, a in enumerate(row):
            if a is not None:
                done_at[(a.kind, stage_of(a, r, pp), a.micro)] = t
                position[r] += 1
        ticks.append(row)
    return ticks


def _message(action: Action, rank: int, pp: int, v: int):
    """What `action` sends when it finishes, or None (first / last virtual stage)."""
    s = stage_of(action, rank, pp)
    if action.kind == "F" and s < pp * v - 1:
        return Message("act", s + 1, action.micro, rank, (s + 1) % pp)
    if action.kind == "B" and s > 0:
        return Message("grad", s - 1, action.micro, rank, (s - 1) % pp)
    return None


def rank_steps(ticks: list, rank: int, v: int = 1) -> list:
    """This rank's Steps: at each tick where it computes or communicates, the action (or None),
    the messages it sends after it, and the messages it receives in the same exchange."""
    pp = len(ticks[0])
    steps = []
    for t, row in enumerate(ticks):
        messages = [_message(a, r, pp, v) for r, a in enumerate(row) if a is not None]
        sends = [m for m in messages if m is not None and m.src == rank]
        recvs = [m for m in messages if m is not None and m.dst == rank]
        if row[rank] is not None or sends or recvs:
            steps.append(Step(t, row[rank], sends, recvs))
    return steps


def idle_slots(ticks: list) -> int:
    """Ticks, summed over ranks, in which a rank computes nothing: the pipeline bubble."""
    return sum(a is None for row in ticks for a in row)


def peak_alive(order: list) -> int:
    """The most micro-batches whose activations a rank holds at once (forwarded, not yet
    backwarded), over all its chunks."""
    alive = peak = 0
    for a in order:
        alive += 1 if a.kind == "F" else -1
        peak = max(peak, alive)
    return peak
