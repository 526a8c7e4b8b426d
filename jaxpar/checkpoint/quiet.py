"""Orbax's noise: a failed background save collapsed to the one line the caller reports, and the
warnings of a read-only open dropped.

A failed background write (a full disk, a lost mount) is reported many times over by the layers
under a save: each array's asyncio write task logs "Task exception was never retrieved", Orbax's
signalling and commit threads log the exception with its traceback, and TensorStore callbacks that
arrive after their event loop closed raise "Event loop is closed" as unraisable exceptions.
Measured on a full 2 MiB tmpfs: 62 tracebacks, 673 lines on stderr for one failed save. The error
itself reaches the caller at the next `save` or `wait`, which reports it in one line
(`jaxpar.train.loop`), so while any `Checkpoints` is open those records are dropped; the first
one's first line is kept (`first_error`) for a failure that never reaches a caller. After a
failure the filters stay for the rest of the process: the asyncio futures of the failed writes
report again when they are garbage-collected, which may be at exit.

A checkpoint opened to be read (`Checkpoints(read_only=True)`: scripts/convert.py --to_hf,
scripts/sample.py, evaluation beside a live run) made Orbax warn "Given directory is read only" and
"CheckpointManagerOptions.read_only=True, setting save_interval_steps=0": true of every reader by
design, and read by users as a problem. `read_only_notices_dropped` drops exactly those two while the
reader is opened.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

# Loggers Orbax's failure reports arrive on: absl (Orbax logs through absl.logging) and asyncio.
LOGGERS = ("absl", "asyncio")


def _from_orbax(record: logging.LogRecord) -> bool:
    if "orbax" in record.pathname or "orbax" in record.getMessage():
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _Noise(logging.Filter):
    def __init__(self):
        super().__init__()
        self.users, self.first_error, self._previous_hook, self.failed = 0, None, None, False
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not _from_orbax(record):
            return True
        if self.first_error is None:
            self.first_error = (record.getMessage().strip().splitlines() or [""])[0]
        return False

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
            return
        self._previous_hook(unraisable)

    def open(self) -> None:
        with self._lock:
            self.users += 1
            if self.users > 1:
                return
            for name in LOGGERS:
                logging.getLogger(name).addFilter(self)  # idempotent
            if sys.unraisablehook != self._unraisable:  # still installed after a failure
                self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable

    def close(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users > 0 or self.failed:
                return
            for name in LOGGERS:
                logging.getLogger(name).removeFilter(self)
            if sys.unraisablehook == self._unraisable:
                sys.unraisablehook = self._previous_hook

    def take_first_error(self, *, failed: bool = False) -> str | None:
        """The first dropped record's line (cleared); `failed`: a write failed, keep filtering."""
        error, self.first_error = self.first_error, None
        self.failed = self.failed or failed
        return error


NOISE = _Noise()


# The starts of the warnings Orbax logs on every read-only open (orbax.checkpoint.CheckpointManager
# and its options).
READ_ONLY_NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True")
# What Orbax logs when a type handler replaces its default one (manager.py replaces jax.Array's on purpose).
OVERRIDE_NOTICES = ("Type handler registry type",)


class _Notices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(self.starts) and _from_orbax(record))


@contextlib.contextmanager
def notices_dropped(starts: tuple[str, ...]):
    """While inside: Orbax's warnings that begin with one of `starts` are dropped, nothing else."""
    drop, logger = _Notices(starts), logging.getLogger(LOGGERS[0])
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def read_only_notices_dropped():
    """While a checkpoint is opened read-only: Orbax's read-only warnings are dropped, nothing else."""
    return notices_dropped(READ_ONLY_NOTICES)
