"""Progress output of the training loop, on process 0 only.

Start-up (`StartupLog`): one line per phase — checking, building, compiling, reading data, restoring
or initialising — begun when the phase begins, so a long compile says what is happening, and ended
with its time: `compiling the train step ... 4.1 s`. With a `clock` (`jaxpar.train.goodput.Ledger`)
each phase's time is also charged to its `kind` (compile, input, restore, other) for the run's
goodput: one timing for both.

Steps: on a terminal, a tqdm bar with loss and tokens/s. Anywhere else (a SLURM log, a pipe, a
file): one plain line every `train.log_every` steps, since carriage-return redraws turn such logs
into one endless line. Numbers read plainly: 4 significant digits, thousands as `13,820`, never
`1.382e+04`.
"""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm.auto import tqdm


def _format(value) -> str:
    if not isinstance(value, float):
        return str(value)
    if abs(value) >= 1000:  # a rate or a large norm: whole units with separators, not an exponent
        return f"{value:,.0f}"
    return f"{value:.4g}"


class StartupLog:
    """Lines of the run's start-up: `phase(label)` around each phase, `say(line)` for anything else.

    A phase's line is left open while it runs (`label ...`) and closed with its time; a line said
    meanwhile closes it first, and the time then follows on a line of its own (`label: 1.2 s`).
    `open_lines=False` (a multi-process run, where Gloo's C++ threads write to the same stdout) never
    leaves a line open: `label ...` when the phase begins, `label: 1.2 s` when it ends. Disabled
    (processes other than 0): prints nothing."""

    def __init__(self, enabled: bool = True, out=None, open_lines: bool = True, clock=None):
        self.enabled, self.out, self.open_lines, self.clock = enabled, out, open_lines, clock
        self._open: str | None = None  # the label of the phase whose line is unfinished

    def _print(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.out or sys.stdout, flush=True)

    def say(self, line: str) -> None:
        if not self.enabled:
            return
        if self._open is not None:
            self._print("")
            self._open = None
        self._print(line)

    @contextlib.contextmanager
    def phase(self, label: str, kind: str = "other"):
        with self.clock.timed(kind) if self.clock is not None else _stopwatch() as elapsed:
            if not self.enabled:
                yield
                return
            if self._open is not None:
                self._print("")
            self._print(f"{label} ...", end="" if self.open_lines else "\n")
            self._open = label if self.open_lines else None
            try:
                yield
            finally:
                seconds = f"{elapsed():.1f} s"
                if self._open == label:
                    self._print(f" {seconds}")
                else:  # something was said meanwhile
                    self._print(f"{label}: {seconds}")
                self._open = None


@contextlib.contextmanager
def _stopwatch():
    """Yields a function giving the seconds since the block began (the timer of a log without a clock)."""
    started = time.perf_counter()
    yield lambda: time.perf_counter() - started


class Progress:
    LINE_KEYS = ("loss", "grad_norm", "learning_rate", "tokens_per_sec")

    def __init__(self, total: int, start: int, log_every: int, *, enabled: bool = True, tty: bool | None = None):
        self.total, self.log_every, self.enabled = total, max(int(log_every), 1), enabled
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.bar = tqdm(total=total, initial=start, desc="train", disable=not (enabled and self.tty))

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.bar.update(1)
            if record["step"] % self.log_every == 0 or record["step"] == self.total:
                self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        elif record["step"] % self.log_every == 0 or record["step"] == self.total:
            fields = "  ".join(f"{k} {_format(record[k])}" for k in self.LINE_KEYS if k in record)
            print(f"step {record['step']}/{self.total}  {fields}", flush=True)

    def write(self, line: str) -> None:
        """A message that does not break the bar."""
        if self.enabled:
            (self.bar.write if self.tty else print)(line)
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
