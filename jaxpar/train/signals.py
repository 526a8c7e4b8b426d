"""Ctrl-C and SIGTERM (preemption): finish the step, save, exit with a one-line message.

Outside the training loop a signal raises `Interrupted` at once (nothing has been written yet).
Inside it (`deferred()`), the first signal only records itself: the loop finishes its step, saves a
final checkpoint and raises `Interrupted` itself; a second signal raises at once. In a
multi-process run a signal may reach only some processes, so the loop asks `agreed()` after each
step: one tiny all-gather, and every process stops at the same step.
"""

from __future__ import annotations

import contextlib
import signal
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
    """Installs SIGINT/SIGTERM handlers for its `with` block (main thread only)."""

    def __init__(self):
        self.received: int | None = None
        self._deferring = False
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if not self._deferring or self.received is not None:
            raise Interrupted(signum)
        self.received = signum
        print(
            f"received {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
            f"(send it again to quit at once)",
            flush=True,
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in HANDLED}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @contextlib.contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def agreed(self) -> int | None:
        """The signal any process received (the same answer on every process), or None."""
        if jax.process_count() == 1:
            return self.received
        received = multihost_utils.process_allgather(np.asarray([self.received or 0], np.int32), tiled=True)
        signals = [int(s) for s in np.asarray(received) if s]
        return signals[0] if signals else None
