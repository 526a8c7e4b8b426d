"""The analytic model next to what XLA compiled: memory, FLOPs and bytes per mesh axis.

`compare(config, devices)` compiles jaxpar's step (`compiled.compile_step`), prices the same
config with the XLA:CPU lowering (`cost_model.estimate(..., target="cpu")`) and lines them up.
`Fidelity.unexpected` lists (kind, axes) pairs the compiled program moves bytes on but the
model plans none of that kind there; `Fidelity.missing` the reverse.
"""

from __future__ import annotations

import dataclasses

from jaxpar.analysis.compiled import CompiledStep, compile_step
from jaxpar.analysis.cost_model import Estimate, estimate


@dataclasses.dataclass(frozen=True)
class AxisBytes:
    axes: tuple[str, ...]
    predicted: float
    compiled: float

    @property
    def error(self) -> float:
        """Relative error of the prediction (compiled as reference; 0 when both are 0)."""
        if self.compiled == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return self.predicted / self.compiled - 1


@dataclasses.dataclass
class Fidelity:
    estimate: Estimate
    compiled: CompiledStep

    @property
    def memory_error(self) -> float:
        return self.estimate.memory.peak / self.compiled.memory.live_total - 1

    @property
    def flops_error(self) -> float:
        return self.estimate.flops_per_device / self.compiled.hlo_matmul_flops - 1

    def axis_bytes(self) -> list[AxisBytes]:
        predicted = self.estimate.wire_bytes_by_axes()
        compiled = self.compiled.wire_bytes_by_axes()
        return [AxisBytes(a, predicted.get(a, 0.0), compiled.get(a, 0.0)) for a in sorted(set(predicted) | set(compiled))]

    def unexpected(self, min_fraction: float = 0.0) -> list:
        """Compiled (kind, axes) totals with no planned collective of that kind on those axes and
        at least `min_fraction` of the step's compiled wire bytes."""
        planned = {(p.kind, p.axes) for p in self.estimate.collectives}
        total = sum(t.wire_bytes for t in self.compiled.comm_totals()) or 1.0
        return [
            t for t in self.compiled.comm_totals()
            if (t.kind, t.axes) not in planned and t.wire_bytes >= min_fraction * total
        ]

    def missing(self) -> list:
        compiled = {(t.kind, t.axes) for t in self.compiled.comm_totals()}
        mesh = self.estimate.layout.mesh
        return [p for p in self.estimate.collectives if p.axes and p.wire_bytes(mesh) > 0 and (p.kind, p.axes) not in compiled]

    def table(self) -> str:
        lines = [
            f"{self.estimate.layout.describe()}: peak memory predicted {self.estimate.memory.peak / 1e6:.2f} MB, "
            f"compiled {self.compiled.memory.live_total / 1e6:.2f} MB ({100 * self.memory_error:+.1f}%); "
            f"matmul FLOPs {self.estimate.flops_per_device / 1e9:.3f} vs {self.compiled.hlo_matmul_flops / 1e9:.3f} G "
            f"({100 * self.flops_error:+.1f}%)"
        ]
        for row in self.axis_bytes():
            lines.append(
                f"  {','.join(row.axes):22s} wire predicted {row.predicted / 1e6:9.3f} MB, compiled {row.compiled / 1e6:9.3f} MB"
                f" ({100 * row.error:+.1f}%)"
            )
        for t in self.unexpected():
            lines.append(f"  unexpected: {t.kind} over {t.axes}: {t.wire_bytes / 1e6:.3f} MB in {t.instructions} ops")
        for p in self.missing():
            lines.append(f"  missing: {p.kind} over {p.axes}: {p.what}")
        return "\n".join(lines)


def compare(config, devices=None) -> Fidelity:
    compiled = compile_step(config, devices)
    return Fidelity(estimate(config, num_devices=compiled.num_devices, target="cpu"), compiled)
