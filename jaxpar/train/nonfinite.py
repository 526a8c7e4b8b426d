"""What the loop does after a non-finite step (policy `train.on_nonfinite`, caps in `config.train`).

The step itself (`jaxpar.train.step`) already decided, inside the jitted program, whether the step
was finite; a non-finite one left params and optimizer state as they were and counted itself in
`loss_scale.skipped_steps`, which comes back with the metrics the loop fetches anyway. This module
only reads that count: no extra device work or host sync per step.

- fp32 / bf16, `on_nonfinite="stop"` (default): stop at the first non-finite step, naming the step,
  the quantity (loss or gradient norm) and a hint; the bad update was never applied, and the loop
  saves no checkpoint after it, so the last good checkpoint stays the latest.
- fp32 / bf16, `on_nonfinite="skip"`: go on, and stop once more than `max_skipped_steps` were skipped.
- fp16: overflow is expected and handled by the dynamic loss scale; stop when a step overflows at
  the smallest scale (1: nothing left to lower), or when more than `max_skipped_fraction` of the
  last `skip_window` steps were skipped.
"""

from __future__ import annotations

import collections
import math

MIN_LOSS_SCALE = 1.0  # jaxpar.train.loss_scale never halves below this


class NonFiniteStop(RuntimeError):
    """The run stopped for non-finite values; the message is one line."""


class NonFiniteGuard:
    def __init__(self, train, skipped_before: int = 0):
        self.fp16 = train.compute_dtype == "float16"
        self.policy, self.cap = train.on_nonfinite, int(train.max_skipped_steps)
        self.max_fraction, self.window = float(train.max_skipped_fraction), collections.deque(maxlen=int(train.skip_window))
        self.skipped = int(skipped_before)  # counted in the state, so it survives a resume

    def observe(self, step: int, metrics: dict) -> None:
        """Raises NonFiniteStop if the run must stop after step `step` (metrics: that step's, fetched)."""
        total = int(metrics["skipped_steps"])
        new, self.skipped = total - self.skipped, total
        if self.fp16:
            self._fp16(step, new > 0, float(metrics["loss_scale"]))
        elif new > 0:
            self._full_precision(step, total, float(metrics["loss"]), float(metrics["grad_norm"]))

    def _fp16(self, step: int, skipped: bool, scale: float) -> None:
        self.window.append(skipped)
        if skipped and scale <= MIN_LOSS_SCALE:
            raise NonFiniteStop(
                f"step {step}: fp16 gradients overflow even at the smallest loss scale ({MIN_LOSS_SCALE:g}); stopped. "
                f"Lower train.learning_rate or use train.compute_dtype=bfloat16"
            )
        if len(self.window) == self.window.maxlen and sum(self.window) > self.max_fraction * len(self.window):
            raise NonFiniteStop(
                f"step {step}: {sum(self.window)} of the last {len(self.window)} fp16 steps overflowed and were skipped, "
                f"more than train.max_skipped_fraction={self.max_fraction}; stopped. "
                f"Lower train.learning_rate or use train.compute_dtype=bfloat16"
            )

    def _full_precision(self, step: int, total: int, loss: float, grad_norm: float) -> None:
        what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm})"
        if self.policy == "stop":
            raise NonFiniteStop(
                f"step {step}: non-finite {what}; stopped before applying it, the workdir and the last checkpoint "
                f"are intact. Lower train.learning_rate, check the data, or set train.on_nonfinite=skip"
            )
        if total > self.cap:
            raise NonFiniteStop(
                f"step {step}: non-finite {what}; {total} steps skipped in all, more than "
                f"train.max_skipped_steps={self.cap}; stopped. Lower train.learning_rate or check the data"
            )
