"""Ctrl-C and SIGTERM (preemption): stop at a safe point with a one-line message; again: quit at once.

The handler never raises. A signal may arrive while the main thread is inside native code (XLA's
compile, a step, a collective), where an exception raised by a Python handler crashed the process
(issue 25: exit 139 in 8 of 10 tries during the AOT compile). So the first signal is only recorded,
and the run stops at the next safe point:
- during start-up, at the end of the phase it arrived in (`check`: preflight, loading data, build,
  restore or init, compile): `Interrupted`, one line, nothing of an earlier run changed;
- in the training loop (`deferred()`), after the step: the loop saves a final checkpoint and raises
  `Interrupted` itself.
A second signal quits at once, even while the main thread is blocked in native code (where Python
handlers do not run): the C-level handler writes each signal to a pipe (`signal.set_wakeup_fd`),
and a watcher thread counts them and ends the process with `os._exit(128 + signum)` and one line.
In a multi-process run a signal may reach only some processes, so `agreed()` (one tiny all-gather)
gives every process the same answer, at each start-up phase's end and after each step.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    def __init__(self, signum: int, message: str = ""):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")


class StopSignals:
    """Installs SIGINT/SIGTERM handling for its `with` block (main thread only; elsewhere inert)."""

    def __init__(self):
        self.received: int | None = None
        # One line naming what a quit-at-once leaves behind (set by the loop as the run goes on).
        self.quit_note = "nothing of an earlier run was changed"
        self._deferring = False
        self._previous: dict = {}
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._count = 0

    # -- the first signal: record it -------------------------------------------------------

    def _first(self, signum: int) -> None:
        with self._lock:
            if self.received is not None:
                return
            self.received = signum
        name = signal.Signals(signum).name
        where = "finishing this step and saving a checkpoint" if self._deferring else "stopping after this start-up phase"
        sys.stdout.write(f"received {name}: {where} (send it again to quit at once)\n")
        sys.stdout.flush()

    def _handle(self, signum, frame):
        """The Python-level handler (main thread, between bytecodes): records, never raises."""
        del frame
        self._first(signum)

    # -- the second signal: quit at once (watcher thread) -----------------------------------

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                select.select([read_fd], [], [])
                data = os.read(read_fd, 64)
            except BlockingIOError:
                continue
            if not data:  # the write end was closed: the `with` block ended
                os.close(read_fd)  # here, not there: closing an fd another thread selects on races its reuse
                return
            for signum in data:
                if signum not in HANDLED:
                    continue
                self._count += 1
                if self._count == 1:
                    self._first(signum)
                else:
                    self._quit(signum)

    def _quit(self, signum: int) -> None:
        name = signal.Signals(signum).name
        line = f"interrupted by {name} again: quit at once without a final checkpoint; {self.quit_note}\n"
        os.write(2, line.encode())  # no Python stream locks: the main thread may hold them
        os._exit(128 + signum)

    # -- installing ------------------------------------------------------------------------

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd needs a non-blocking fd
        os.set_blocking(read_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous = {s: signal.signal(s, self._handle) for s in HANDLED}
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="jaxpar-signals", daemon=True).start()
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            read_fd, write_fd = self._pipe
            self._pipe = None
            del read_fd
            os.close(write_fd)  # the watcher reads end-of-file, closes its end and returns

    @contextlib.contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    # -- asking ----------------------------------------------------------------------------

    def agreed(self) -> int | None:
        """The signal any process received (the same answer on every process), or None."""
        if jax.process_count() == 1:
            return self.received
        received = multihost_utils.process_allgather(np.asarray([self.received or 0], np.int32), tiled=True)
        signals = [int(s) for s in np.asarray(received) if s]
        return signals[0] if signals else None

    def check(self, phase: str, resuming: bool | None = None) -> None:
        """At the end of start-up phase `phase`: Interrupted (one line) if any process got a signal."""
        signum = self.agreed()
        if signum is None:
            return
        then = "" if resuming is None else f": rerun the same command to {'resume' if resuming else 'start'}"
        raise Interrupted(
            signum, f"interrupted by {signal.Signals(signum).name} during start-up ({phase}); {self.quit_note}{then}"
        )
