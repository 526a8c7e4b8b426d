"""Progress output of the training loop, on process 0 only.

On a terminal: a tqdm bar with loss and tokens/s. Anywhere else (a SLURM log, a pipe, a file): one
plain line every `train.log_every` steps, since carriage-return redraws turn such logs into one
endless line.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


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
