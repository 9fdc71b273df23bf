"""A search's work shared with a second process where the machine has a second core: the
items (a search's grids) dealt between this process and a child forked from it, each working
through its share; the child sends its outcomes back pickled, and they are put back in the
items' order, so that the result is the one this process alone would give.

    share_work(work, items, processes, kind, weight) -> (work(items), processes that worked)

work(list of items) -> [one outcome per item], a function of each item alone (its caches may
be shared between items, not its outcomes). Items of one kind(item) share most of what work
caches (a search's grids of one pp: their pipelines' schedules and batched simulations,
which cost as much for a few layouts as for many), so a kind stays in one process; the kinds
are dealt heaviest first, each to the process with the least weight(item) so far. The child
inherits everything by fork, so `work` may be a closure. Where fork is missing (not POSIX),
only one core is free to this process, there is one kind, or the child fails in any way (it
is then ended and its share worked here), this process works through every item itself.
"""
import os
import pickle
import signal


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_processes() -> int:
    """2 where fork exists and two cores are free to this process, else 1."""
    return 2 if hasattr(os, "fork") and cores() >= 2 else 1


def share_work(work, items: list, processes: int, kind=None, weight=None) -> tuple:
    """(work(items), 1 or 2): a share of the items' kinds worked through by a forked child
    when `processes` is 2 (module docstring); kind, weight: functions of an item (None: each
    item its own kind, of weight 1)."""
    if processes < 2 or not hasattr(os, "fork"):
        return work(items), 1
    ours, theirs = _deal(items, kind or id, weight or (lambda item: 1))
    if not ours or not theirs:
        return work(items), 1
    read, write = os.pipe()
    try:
        child = os.fork()
    except OSError:                 # no memory or process left for a child
        os.close(read)
        os.close(write)
        return work(items), 1
    if child == 0:
        _work_in_child(work, [items[i] for i in theirs], read, write)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        try:
            done = work([items[i] for i in ours])
            sent = pipe.read()
        except BaseException:       # (an interrupt, or the error the child would meet too)
            _end(child)
            raise
    _, status = os.waitpid(child, 0)
    outcomes = [None] * len(items)
    for i, outcome in zip(ours, done):
        outcomes[i] = outcome
    shared = status == 0 and bool(sent)
    done = pickle.loads(sent) if shared else work([items[i] for i in theirs])
    for i, outcome in zip(theirs, done):
        outcomes[i] = outcome
    return outcomes, 2 if shared else 1


def _deal(items: list, kind, weight) -> tuple:
    """([indices of this process's items], [the child's]), each in the items' order: the
    kinds, heaviest first, each to the share of least weight so far."""
    kinds = {}
    for i, item in enumerate(items):
        kinds.setdefault(kind(item), []).append(i)
    shares, weights = ([], []), [0, 0]
    for indices in sorted(kinds.values(), key=lambda ix: -sum(weight(items[i]) for i in ix)):
        lighter = weights.index(min(weights))
        shares[lighter].extend(indices)
        weights[lighter] += sum(weight(items[i]) for i in indices)
    return sorted(shares[0]), sorted(shares[1])


def _work_in_child(work, share, read, write):
    """The child's life: its share's outcomes pickled into the pipe, then its exit, without
    the parent's exit handlers (os._exit): status 0 only once all was sent."""
    status = 1
    try:
        os.close(read)
        sent = pickle.dumps(work(share), protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(write, "wb") as pipe:
            pipe.write(sent)
        status = 0
    finally:
        os._exit(status)


def _end(child):
    """The child ended and reaped, where this process stops before it has read the child's
    outcomes."""
    try:
        os.kill(child, signal.SIGKILL)
    except OSError:             # the child already gone
        pass
    os.waitpid(child, 0)
