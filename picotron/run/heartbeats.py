"""Heartbeats: how the watchdog (picotron/run/watchdog.py) tells a frozen rank from a slow one.

Every rank beats, writing a counter and the steps it has finished under its rank in the
launcher's store: at each new step (setting the watchdog's step wakes its thread) and every
I = heartbeat_s / 4, when it also reads every other rank's beat. A rank whose beat has not
changed for heartbeat_s has stopped: SIGSTOP, swapped out, a host that hangs.

The bound. Say a rank freezes at time f; its last beat went out at some b <= f. A reader
checks at times fixed in advance, c, c + I, c + 2I, ... (the wait to the next check is
computed, so the checks do not drift by the watchdog's tick), and dates a beat it finds
changed by the check before it, when that beat was certainly not yet sent: c_prev < b. It
names the rank at the first check where that date is heartbeat_s old: at c_prev + 4I <= f +
heartbeat_s. So a frozen rank is named at most heartbeat_s after it froze, plus however late
a loaded machine runs the reader's check; the stated bound, heartbeat_s + heartbeat_s / 4
(picotron/config/checks.py refuses a heartbeat_s whose bound reaches distributed.timeout_s),
leaves that quarter for the load. A live rank beats at least every I plus one tick, so a beat
dated a check early looks at most about 2I + one tick old, half of heartbeat_s: only a
watchdog thread starved of the CPU for heartbeat_s / 2 is taken for frozen.
"""
import json

QUIET_TICK_S = 0.5       # the longest the watchdog's thread sleeps between two looks


class Heartbeats:
    """beats = Heartbeats(rank, limit_s); the thread, each time it wakes: when
    `beats.due(now)` or the step changed, store `beats.next_beat(step)` under this rank; when
    due, read the others' and `beats.check({rank: beat or None}, now)` -> a message or None;
    sleep at most `beats.wait_s(now)`."""

    def __init__(self, rank: int, limit_s: float):
        self.rank, self.limit, self.every = rank, limit_s, limit_s / 4
        self.count, self.beaten_step = 0, None     # this rank's beats, the step of its last
        self.next_check = self.last_check = None   # monotonic times
        self.seen = {}    # rank -> (its beat as last read, the time it is dated, read first)

    def due(self, now: float) -> bool:
        return self.next_check is None or now >= self.next_check

    def wait_s(self, now: float) -> float:
        if self.next_check is None:
            return QUIET_TICK_S
        return max(0.0, min(QUIET_TICK_S, self.next_check - now))

    def next_beat(self, step: int) -> str:
        """This rank's next beat, as stored: [count, steps finished]."""
        self.count, self.beaten_step = self.count + 1, step
        return json.dumps([self.count, step])

    def check(self, beats: dict, now: float):
        """`beats`: {rank: its beat as read just now, None if it never beat} for the ranks
        still running. The message naming one silent for heartbeat_s, or None."""
        dated = self.last_check if self.last_check is not None else now
        scheduled = self.next_check if self.next_check is not None else now
        self.last_check, self.next_check = now, max(scheduled + self.every, now)
        for r, beat in beats.items():
            if r not in self.seen or self.seen[r][0] != beat:    # first read, or it beat
                self.seen[r] = (beat, dated, now)
            if now - self.seen[r][1] >= self.limit:
                return silent_rank(r, beat, now - self.seen[r][2], now - self.seen[r][1],
                                   self.limit)
        return None


def silent_rank(rank: int, beat, least: float, most: float, limit: float) -> str:
    """The message naming `rank`, whose last beat went out `least` to `most` seconds ago
    (between the check that found it and the one before)."""
    if isinstance(beat, bytes):
        beat = beat.decode()
    at = (f"it stopped beating after step {json.loads(beat)[1]}" if beat is not None
          else "it never beat: it froze or died while starting")
    silent = f"{most:.1f} s" if most - least < 0.05 else f"{least:.1f}-{most:.1f} s"
    return (f"rank {rank} has sent no heartbeat for {silent} "
            f"(distributed.heartbeat_s={limit:g}); {at}")
