"""The analytic model next to what XLA compiled: memory, FLOPs and bytes per mesh axis.

`compare(config, devices)` compiles jaxpar's step (`compiled.compile_step`), prices the same
config with the XLA:CPU lowering (`cost_model.estimate(..., target="cpu")`) and lines them up.
`Fidelity.unexpected` lists (kind, axes) pairs the compiled program moves bytes on but the
model plans none of that kind there; `Fidelity.missing` the reverse.

Pipeline stages run in `lax.switch` branches, which the HLO count takes every time step (an
upper bound). `pipeline_branch_runs` counts, per pipeline rank, how often each branch of the
engine's forward and backward switch runs from the schedule's slot tables, so the compiled
bytes per axis are exact: the busiest rank's.
"""

from __future__ import annotations

import dataclasses

from jaxpar.analysis.compiled import CompiledStep, compile_step
from jaxpar.analysis.cost_model import Estimate, estimate
from jaxpar.parallel.pipeline.slots import slot_plan_for


def pipeline_branch_runs(compiled: CompiledStep, layout) -> list[dict]:
    """Per pipeline rank, {(conditional, branch index): runs per step} for the engine's forward
    switch (two branches) and backward switch (`SlotPlan.back_branches`), matched by their branch
    counts and by running once per schedule time step; [] when they cannot be told apart."""
    plan = slot_plan_for(layout.schedule, layout.p, layout.microbatches, layout.virtual_stages)
    steps = plan.tables["fwd_branch"].shape[0]
    tables = {2: plan.tables["fwd_branch"], len(plan.back_branches): plan.tables["back_branch"]}
    if len(tables) < 2:
        return []
    matched = {name: tables[n] for name, (n, runs) in compiled.conditionals.items() if n in tables and runs == steps}
    return [
        {(name, b): int((table[:, r] == b).sum()) for name, table in matched.items() for b in range(table.max() + 1)}
        for r in range(layout.p)
    ]


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

    def _rank_runs(self) -> list:
        return pipeline_branch_runs(self.compiled, self.estimate.layout) if self.estimate.layout.p > 1 else []

    def compiled_bytes_by_axes(self) -> dict:
        """Compiled wire bytes per mesh-axis set: with a pipeline, each axis's busiest rank's
        (branch runs from the schedule), else every collective as counted."""
        ranks = self._rank_runs()
        if not ranks:
            return self.compiled.wire_bytes_by_axes()
        out: dict = {}
        for runs in ranks:
            for axes, b in self.compiled.wire_bytes_by_axes(runs).items():
                out[axes] = max(out.get(axes, 0.0), b)
        return out

    def compiled_totals(self) -> list:
        """`comm_totals` of the busiest pipeline rank (every rank alike without a pipeline)."""
        ranks = self._rank_runs()
        if not ranks:
            return self.compiled.comm_totals()
        return max((self.compiled.comm_totals(runs) for runs in ranks), key=lambda ts: sum(t.wire_bytes for t in ts))

    def axis_bytes(self) -> list[AxisBytes]:
        predicted = self.estimate.wire_bytes_by_axes()
        compiled = self.compiled_bytes_by_axes()
        return [AxisBytes(a, predicted.get(a, 0.0), compiled.get(a, 0.0)) for a in sorted(set(predicted) | set(compiled))]

    def unexpected(self, min_fraction: float = 0.0) -> list:
        """Compiled (kind, axes) totals with no planned collective of that kind on those axes and
        at least `min_fraction` of the step's compiled wire bytes."""
        planned = {(p.kind, p.axes) for p in self.estimate.collectives}
        totals = self.compiled_totals()
        total = sum(t.wire_bytes for t in totals) or 1.0
        return [
            t for t in totals
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
