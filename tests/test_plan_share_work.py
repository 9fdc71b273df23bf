"""share_work deals a search's grids between this process and a forked child: the outcomes
come back in the items' order, each kind in one process, and a child that fails leaves its
share to this process, with the same outcomes."""
import os

import pytest

from picotron.plan.share_work import share_work

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this system")
ITEMS = [(kind, n) for n in range(5) for kind in "abcd"]      # 20 items of 4 kinds


def worked_by(items):
    """Each item with the process that worked it."""
    return [(item, os.getpid()) for item in items]


@needs_fork
def test_each_kind_is_worked_in_one_process_and_the_outcomes_keep_the_items_order():
    outcomes, processes = share_work(worked_by, ITEMS, 2, kind=lambda item: item[0],
                                     weight=lambda item: 1 + (item[0] == "a"))
    assert processes == 2 and [item for item, _ in outcomes] == ITEMS
    by_kind = {}
    for (kind, _), pid in outcomes:
        by_kind.setdefault(kind, set()).add(pid)
    assert all(len(pids) == 1 for pids in by_kind.values())
    pids = {pid for _, pid in outcomes}
    assert os.getpid() in pids and len(pids) == 2
    # heaviest first, each to the lighter share: "a" (10 of 25) to one, "b" and "c" (5 each)
    # to the other, then "d" to the first (a tie goes to this process's share)
    assert by_kind["a"] == by_kind["d"] == {os.getpid()} and by_kind["b"] == by_kind["c"]


@needs_fork
def test_a_child_that_fails_leaves_its_share_to_this_process():
    parent = os.getpid()

    def fails_in_the_child(items):
        if os.getpid() != parent:
            os._exit(3)             # as a child killed mid-way: nothing sent
        return [item[1] * 10 for item in items]
    outcomes, processes = share_work(fails_in_the_child, ITEMS, 2, kind=lambda item: item[0])
    assert processes == 1 and outcomes == [n * 10 for _, n in ITEMS]


@pytest.mark.parametrize("processes, kind", [(1, lambda item: item[0]),
                                             (2, lambda item: "one kind")])
def test_one_process_or_one_kind_works_every_item_here(processes, kind):
    outcomes, used = share_work(worked_by, ITEMS, processes, kind=kind)
    assert used == 1 and outcomes == [(item, os.getpid()) for item in ITEMS]


@needs_fork
def test_an_error_in_this_process_share_is_raised_and_the_child_ended(monkeypatch):
    parent, children, fork = os.getpid(), [], os.fork

    def fork_noted():
        pid = fork()
        if pid:
            children.append(pid)
        return pid
    monkeypatch.setattr(os, "fork", fork_noted)

    def fails_here(items):
        if os.getpid() == parent:
            raise ValueError("this share failed")
        return list(items)
    with pytest.raises(ValueError, match="this share failed"):
        share_work(fails_here, ITEMS, 2, kind=lambda item: item[0])
    assert len(children) == 1
    # reaped: waiting on it again finds no such child (other tests' children may still live,
    # so ask for this one, not for any)
    with pytest.raises(ChildProcessError):
        os.waitpid(children[0], os.WNOHANG)
