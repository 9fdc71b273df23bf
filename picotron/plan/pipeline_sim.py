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


def _needs(kind, stage, micro, last):
    """The (kind, stage, micro) whose output this action consumes, or None."""
    if kind == "F":
        return None if stage == 0 else ("F", stage - 1, micro)
    return None if stage == last else ("B", stage + 1, micro)


@functools.lru_cache(maxsize=256)
def _dag(engine, pp, micro_batches, v):
    """The orders as a graph, once per schedule: each action's rank, kind, stage, the action
    before it on its rank and the one whose output it consumes (-1: none), and the actions
    grouped by depth (a level's actions depend only on earlier levels), so that timing the
    graph is one vector step a level."""
    orders = schedule_orders(engine, pp, micro_batches, v)
    last = pp * v - 1
    index, rows, pos, depth = {}, [], [0] * pp, []
    prev = [-1] * pp
    total = sum(len(o) for o in orders)
    while len(rows) < total:
        progressed = False
        for r in range(pp):
            order, at, before = orders[r], pos[r], prev[r]
            while at < len(order):
                kind, chunk, micro = a = order[at]
                s = chunk * pp + r                              # stage_of
                need = _needs(kind, s, micro, last)
                got = -1 if need is None else index.get(need)
                if got is None:
                    break
                index[(kind, s, micro)] = len(rows)
                depth.append(1 + max(depth[before] if before >= 0 else -1,
                                     depth[got] if got >= 0 else -1))
                rows.append((r, kind == "F", s, micro, a.chunk, before, got))
                before = len(rows) - 1
                at += 1
                progressed = True
            pos[r], prev[r] = at, before
        if not progressed:
            raise RuntimeError(f"schedule {engine} deadlocks: every rank waits")
    cols = [np.array(c) for c in zip(*rows)]
    rank, forward, stage, micro, chunk, before, input_of = cols
    depth = np.array(depth)
    order = np.argsort(depth, kind="stable")        # each level's actions in index order
    levels = np.split(order, np.flatnonzero(np.diff(depth[order])) + 1)
    n = len(rows)        # index n stands for "nothing": its end time is 0
    return (rank, forward, stage, micro, chunk, np.where(before < 0, n, before),
            np.where(input_of < 0, n, input_of), input_of >= 0, levels)


def simulate_async(engine, pp, micro_batches, v, forward_s, backward_s, send_s) -> Simulation:
    rank, forward, stage, micro, chunk, before, input_of, has_input, levels = _dag(
        engine, pp, micro_batches, v)
    dur = np.where(forward, np.asarray(forward_s)[stage], np.asarray(backward_s)[stage])
    end = np.zeros(len(dur) + 1)
    start = np.zeros(len(dur))
    for idx in levels:
        start[idx] = np.maximum(end[before[idx]], end[input_of[idx]] + send_s * has_input[idx])
        end[idx] = start[idx] + dur[idx]
    busy = np.bincount(rank, weights=dur, minlength=pp)
    return Simulation(float(end.max()), list(busy),
                      _AsyncTimeline(rank, forward, micro, chunk, start, end[:-1],
                                     input_of, has_input, send_s))


def simulate_async_batch(engine, pp, micro_batches, v, forward_s, backward_s, send_s) -> list:
    """simulate_async for B sets of durations at once (forward_s, backward_s: B rows of S;
    send_s: B), each row's arithmetic the same operations in the same order, so each
    Simulation equals simulate_async's; their timelines are simulated again when read."""
    rank, forward, stage, micro, chunk, before, input_of, has_input, levels = _dag(
        engine, pp, micro_batches, v)
    f, b = np.asarray(forward_s, dtype=float), np.asarray(backward_s, dtype=float)
    send = np.asarray(send_s, dtype=float)
    dur = np.where(forward[:, None], f[:, stage].T, b[:, stage].T)        # (actions, B)
    end = np.zeros((len(dur) + 1, len(send)))
    has = has_input[:, None]
    for idx in levels:
        start = np.maximum(end[before[idx]], end[input_of[idx]] + send * has[idx])
        end[idx] = start + dur[idx]
    makespan = end.max(axis=0)
    out = []
    for j in range(len(send)):
        busy = np.bincount(rank, weights=dur[:, j], minlength=pp)
        args = (engine, pp, micro_batches, v, forward_s[j], backward_s[j], send_s[j])
        out.append(Simulation(float(makespan[j]), list(busy), _Later(args)))
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
