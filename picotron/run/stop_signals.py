"""SIGTERM and Ctrl-C (SIGINT), heard even while the training thread is blocked.

Python runs a signal's handler on the main thread, between two bytecodes: a main thread
blocked inside a collective or a file write (C code) runs it only once that call returns,
which may be never when the peer it waits for is gone. So the handlers installed here do
nothing themselves; `signal.set_wakeup_fd` makes the interpreter's C-level handler write each
signal's number into a socket at once, and the watchdog's thread (picotron/run/watchdog.py),
which waits on that socket, acts on it:

- the first SIGTERM or SIGINT asks every rank to stop after the same step (the watchdog
  publishes that step in the launcher's store), save and exit 143 (SIGTERM) or 130 (SIGINT);
- a second Ctrl-C stops this process at once. A terminal's Ctrl-C reaches torchrun, which
  passes it on to its workers (torch 2.13's torchrun starts them in sessions of their own,
  which a terminal does not signal; a launcher that does not would let each worker hear one
  press twice within milliseconds, which the 2 s below also absorbs).
  At a second Ctrl-C torchrun sends SIGTERM. So any SIGINT or SIGTERM that comes
  `AT_ONCE_AFTER_S` or more after a first SIGINT means "now", and so does the launcher's
  exit after a SIGINT (picotron/run/watchdog.py).

    signals = StopSignals(); signals.install()      # on the main thread
    ... select([signals], ...); signals.received() -> [signal.SIGINT, ...]  # any thread
    signals.restore()                                # on the main thread, at the end
"""
import signal
import socket

HANDLED = (signal.SIGTERM, signal.SIGINT)
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}
EXIT_STATUS = {signal.SIGTERM: 143, signal.SIGINT: 130}     # 128 + the signal's number
AT_ONCE_AFTER_S = 2.0      # a second SIGINT later than this after the first: stop at once


def _ignore(signum, frame) -> None:
    """The Python-level handler: the C-level one has already written to the wakeup socket."""


class StopSignals:
    def __init__(self):
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)     # a full socket drops a byte, never blocks a signal
        self.previous = None               # (wakeup fd, handlers) to restore

    def install(self) -> None:
        """Main thread only (a restriction of the signal module)."""
        wakeup = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        handlers = {s: signal.signal(s, _ignore) for s in HANDLED}
        self.previous = (wakeup, handlers)

    def fileno(self) -> int:
        return self.reader.fileno()

    def received(self) -> list:
        """The signals received since the last call, in order (a thread may call this)."""
        try:
            data = self.reader.recv(4096)
        except (BlockingIOError, OSError):
            return []
        return [signal.Signals(b) for b in data if b in {int(s) for s in HANDLED}]

    def wake(self) -> None:
        """Wake the thread waiting on this socket (a byte that is no signal)."""
        try:
            self.writer.send(b"\0")
        except OSError:
            pass

    def restore(self) -> None:
        """Main thread only: the handlers and wakeup fd from before `install`."""
        if self.previous is None:
            return
        wakeup, handlers = self.previous
        signal.set_wakeup_fd(wakeup)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        self.previous = None
