"""The pipeline's step as a timeline, simulated from the engine's own action lists
(picotron/pipeline_parallel/schedules.py), with each action's modelled duration and each
send's latency: not a closed-form bubble formula, so unequal stages (the embedding on the
first, the head and loss on the last), slow links and the interleaved schedule all show.

    simulate(engine, pp, micro_batches, v, forward_s, backward_s, send_s, mode)
        -> Simulation(makespan_s, busy_s, timeline)

forward_s[s], backward_s[s]: one micro-batch's forward and backward through virtual stage s
(s = chunk * pp + rank, S = pp * v of them); send_s: one activation's (or gradient's) transfer
between neighbouring ranks. Two ways to run the same orders:
    "async"  an action starts once its rank is free and its input has arrived (its producer's
             end plus send_s): an engine with asynchronous sends, as nanotron's
    "ticks"  this project's engine: the orders are run in the ticks of schedules.timeline, and
             after each tick a rank exchanges that tick's messages with its neighbours, waiting
             for them to finish their own tick's compute (schedules.rank_steps)
"""
import functools
from collections import namedtuple
from collections.abc import Sequence

import numpy as np

from picotron.pipeline_parallel.schedules import schedule_orders, stage_of, timeline

Simulation = namedtuple("Simulation", "makespan_s busy_s timeline")


@functools.lru_cache(maxsize=256)
def _dag(engine, pp, micro_batches, v):
    """The orders as a graph, once per schedule: each action's rank, kind, stage, the action
    before it on its rank and the one whose output it consumes (-1: none), and the actions
    grouped by depth (a level's actions depend only on earlier levels), so that timing the
    graph is one vector step a level. An action's index is its place in a sweep over the
    ranks that takes each rank's next actions while their inputs exist (a topological order;
    ties in start time are listed in it)."""
    orders = schedule_orders(engine, pp, micro_batches, v)
    last, m = pp * v - 1, micro_batches
    # an action (kind, stage s, micro) as one int: 2 (s m + micro) + 1 for a forward
    index, cols, depth = {}, [], []
    find, add, deepen = index.get, cols.append, depth.append        # (the loop runs often)
    pos, prev = [0] * pp, [-1] * pp
    total, here = sum(len(o) for o in orders), 0
    while here < total:
        progressed = False
        for r in range(pp):
            order, at, before = orders[r], pos[r], prev[r]
            after, size = depth[before] if before >= 0 else -1, len(order)
            while at < size:
                kind, chunk, micro = order[at]
                s = chunk * pp + r                              # stage_of
                if kind == "F":                                 # its input: F of s - 1
                    got = find(2 * ((s - 1) * m + micro) + 1) if s else -1
                else:                                           # B of s + 1
                    got = find(2 * ((s + 1) * m + micro)) if s != last else -1
                if got is None:
                    break
                index[2 * (s * m + micro) + (kind == "F")] = here
                after = 1 + (after if got < 0 or after >= depth[got] else depth[got])
                deepen(after)
                add((r, kind == "F", s, micro, chunk, before, got))
                before, here, at = here, here + 1, at + 1
            progressed = progressed or at > pos[r]
            pos[r], prev[r] = at, before
        if not progressed:
            raise RuntimeError(f"schedule {engine} deadlocks: every rank waits")
    rank, forward, stage, micro, chunk, before, input_of = (np.array(c) for c in zip(*cols))
    depth = np.array(depth)
    order = np.argsort(depth, kind="stable")        # each level's actions in index order
    n = len(cols)        # index n stands for "nothing": its end time is 0
    # the actions renumbered in `order`, so that a level is a slice [lo, hi); a rank's actions
    # keep their order in it (each is one level deeper than the one before it on its rank)
    at = np.empty(n + 1, dtype=int)
    at[order], at[n] = np.arange(n), n
    has_input = input_of >= 0
    before, inputs = at[np.where(before < 0, n, before)][order], at[np.where(
        has_input, input_of, n)][order]
    has, levels = has_input[order], []
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(depth[order])) + 1, [n]))
    having = np.add.reduceat(has.astype(int), bounds[:-1])     # a level's actions with input
    for lo, hi, some in zip(bounds[:-1].tolist(), bounds[1:].tolist(), having.tolist()):
        levels.append((lo, hi, before[lo:hi], inputs[lo:hi],        # which have an input:
                       True if some == hi - lo else has[lo:hi, None] if some else None))
    return _Graph(rank[order], forward[order], stage[order], levels, at[:n], (
        rank, forward, micro, chunk, np.where(has_input, input_of, n), has_input))


# a schedule's graph: rank, forward, stage of each action in level order; the levels; each
# action's place in level order by its index; and the timeline's columns in index order
_Graph = namedtuple("_Graph", "rank forward stage levels at columns")


def _run(graph, pp, forward_s, backward_s, send_s, starts=True):
    """(start, end, busy) of B simulations: forward_s, backward_s (B, S), send_s (B,); start
    (None unless `starts`) and end (actions, B) in level order (end with a last row of
    zeros), busy (pp, B). An action starts at the later of its rank's previous end and its
    input's end plus send_s; a level with no inputs skips the sum (0 + 0 x send_s is 0, and
    ends are >= 0), one whose every action has an input the product (x 1)."""
    f, b = np.asarray(forward_s, dtype=float), np.asarray(backward_s, dtype=float)
    send = np.asarray(send_s, dtype=float)
    dur = np.where(graph.forward[:, None], f[:, graph.stage].T, b[:, graph.stage].T)
    end = np.zeros((len(dur) + 1, len(send)))
    start = np.empty_like(dur) if starts else None
    for lo, hi, before, inputs, has in graph.levels:     # in place: a level is often small
        first = end[before]
        if has is not None:
            arrived = end[inputs]
            arrived += send if has is True else send * has
            np.maximum(first, arrived, out=first)
        if starts:
            start[lo:hi] = first
        np.add(first, dur[lo:hi], out=end[lo:hi])
    busy = np.zeros((pp, len(send)))        # each rank's durations summed in its order, as
    np.add.at(busy, graph.rank, dur)        # np.bincount sums them
    return start, end, busy


def simulate_async(engine, pp, micro_batches, v, forward_s, backward_s, send_s) -> Simulation:
    graph = _dag(engine, pp, micro_batches, v)
    start, end, busy = _run(graph, pp, [forward_s], [backward_s], [send_s])
    rank, forward, micro, chunk, input_of, has_input = graph.columns
    return Simulation(float(end.max()), busy[:, 0].tolist(),
                      _AsyncTimeline(rank, forward, micro, chunk, start[graph.at, 0],
                                     end[graph.at, 0], input_of, has_input, send_s))


def simulate_async_batch(engine, pp, micro_batches, v, forward_s, backward_s, send_s) -> list:
    """simulate_async for B sets of durations at once (forward_s, backward_s: B rows of S;
    send_s: B), each row's arithmetic the same operations in the same order, so each
    Simulation equals simulate_async's; their timelines are simulated again when read."""
    _, end, busy = _run(_dag(engine, pp, micro_batches, v), pp, forward_s, backward_s, send_s,
                        starts=False)
    makespan = end.max(axis=0)
    out = []
    for j in range(len(send_s)):
        args = (engine, pp, micro_batches, v, forward_s[j], backward_s[j], send_s[j])
        out.append(Simulation(float(makespan[j]), busy[:, j].tolist(), _Later(args)))
    return out


class _Later(Sequence):
    """A batched simulation's timeline: simulate_async's, run when first read."""

    def __init__(self, args):
        self._args, self._events = args, None

    def _timeline(self):
        if self._events is None:
            self._events = simulate_async(*self._args).timeline
        return self._events

    def __getitem__(self, i):
        return self._timeline()[i]

    def __len__(self):
        return len(self._timeline())


class _AsyncTimeline(Sequence):
    """The events (pp_rank, kind, micro, chunk, start_s, end_s) of an async simulation, built
    when first read (a search times thousands of layouts and draws none)."""

    def __init__(self, *columns):
        self._columns, self._events = columns, None

    def _build(self):
        rank, forward, micro, chunk, start, end, input_of, has_input, send_s = self._columns
        events, free = [], {}
        for i in np.argsort(start, kind="stable"):
            r = int(rank[i])
            if has_input[i] and send_s > 0:
                j = input_of[i]
                events.append((int(rank[j]), "send", int(micro[i]), int(chunk[j]),
                               float(end[j]), float(end[j] + send_s)))
            if start[i] > free.get(r, 0.0) + 1e-12:
                events.append((r, "idle", int(micro[i]), int(chunk[i]), free.get(r, 0.0),
                               float(start[i])))
            events.append((r, "F" if forward[i] else "B", int(micro[i]), int(chunk[i]),
                           float(start[i]), float(end[i])))
            free[r] = float(end[i])
        return events

    def __getitem__(self, i):
        if self._events is None:
            self._events = self._build()
        return self._events[i]

    def __len__(self):
        if self._events is None:
            self._events = self._build()
        return len(self._events)


@functools.lru_cache(maxsize=64)
def _ticks(engine, pp, micro_batches, v):
    return timeline(schedule_orders(engine, pp, micro_batches, v), v)


def simulate_ticks(engine, pp, micro_batches, v, forward_s, backward_s, send_s) -> Simulation:
    ticks = _ticks(engine, pp, micro_batches, v)
    last = pp * v - 1
    free = [0.0] * pp
    busy = [0.0] * pp
    events = []
    for row in ticks:
        end = list(free)
        partners = [set() for _ in range(pp)]
        for r, a in enumerate(row):
            if a is None:
                continue
            s = stage_of(a, r, pp)
            dur = forward_s[s] if a.kind == "F" else backward_s[s]
            end[r] = free[r] + dur
            busy[r] += dur
            events.append((r, a.kind, a.micro, a.chunk, free[r], end[r]))
            to = s + 1 if a.kind == "F" else s - 1
            if 0 <= to <= last:                     # a message to the neighbour's stage
                partners[r].add(to % pp)
                partners[to % pp].add(r)
        for r in range(pp):
            if partners[r]:
                ready = max(end[p] for p in partners[r] | {r})
                if ready > end[r]:
                    events.append((r, "idle", -1, -1, end[r], ready))
                events.append((r, "send", -1, -1, ready, ready + send_s))
                free[r] = ready + send_s
            else:
                free[r] = end[r]
    return Simulation(max(free), busy, events)


def simulate(engine, pp, micro_batches, v, forward_s, backward_s, send_s,
             mode="async") -> Simulation:
    """The simulated step of `engine`'s orders (module docstring)."""
    run = simulate_async if mode == "async" else simulate_ticks
    return run(engine, pp, micro_batches, v if engine == "interleaved" else 1,
               forward_s, backward_s, send_s)


def idle_share(sim: Simulation) -> float:
    """The share of the ranks' time (pp x makespan) in which they compute nothing."""
    total = len(sim.busy_s) * sim.makespan_s
    return 1 - sum(sim.busy_s) / total


class TailEvents(Sequence):
    """Each pipeline rank's gradient reduction and optimizer after the simulated makespan, as
    timeline events, built when read."""

    def __init__(self, makespan, tails):
        self.makespan, self.tails = makespan, tails

    def __len__(self):
        return 2 * len(self.tails)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        r, second = divmod(range(len(self))[i], 2)
        dp, opt = self.tails[r]
        start = self.makespan + (dp if second else 0.0)
        return (r, "comm", -1, -1, start, self.makespan + dp + (opt if second else 0.0))


class Joined(Sequence):
    """Two sequences read as one, the first built only when read."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __len__(self):
        return len(self.first) + len(self.second)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.first)
        if i < 0:
            i += len(self)
        return self.first[i] if i < n else self.second[i - n]
