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

import numpy as np

from jaxpar.analysis.cost.cost_model import Estimate, estimate
from jaxpar.analysis.program import hlo
from jaxpar.analysis.program.compiled import CompiledStep, compile_step
from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline.layout import stage_layout
from jaxpar.parallel.pipeline.slots import LAST


def _branch_tables(layout) -> dict:
    """{name: int [T, p] branch index per step and rank} of the engine's three conditionals: the
    forward switch (idle, one branch per stage length, and with "ends" the same again followed by
    the head), the backward switch (idle, then per slot-plan branch one per stage length) and the
    head cond ("spread", or MoE statistics: every rank alike, `steps["has_head"]`)."""
    pipe = layout.plan.pipeline
    plan = pipe.slot_plan
    stages = stage_layout(pipe.stage_layers, layout.p, pipe.virtual_stages, pipe.table.stages)
    n, tab = len(stages.lengths), plan.tables
    ranks = np.arange(layout.p)[None, :]
    fwd_len = stages.tables["length"][ranks, tab["fwd_stage"]]
    back_len = stages.tables["length"][ranks, tab["back_stage"]]
    ends = pipe.vocab != "spread"
    with_head = (tab["fwd_kind"] == LAST) * n if ends else 0
    fwd = np.where(tab["fwd_branch"] == 0, 0, 1 + with_head + fwd_len)
    back = np.where(tab["back_branch"] == 0, 0, 1 + (tab["back_branch"] - 1) * n + back_len)
    head = np.repeat(plan.steps["has_head"][:, None], layout.p, axis=1)
    return {
        "fwd": (1 + n * (2 if ends else 1), fwd),
        "back": (1 + (len(plan.back_branches) - 1) * n, back),
        "head": (2, head),
    }


def _runs_per_rank(table, count: int):
    return np.stack([np.bincount(table[:, r], minlength=count) for r in range(table.shape[1])])


def pipeline_branch_runs(compiled: CompiledStep, layout) -> list[dict]:
    """Per pipeline rank, {(conditional, branch index): runs per step} for the engine's forward
    and backward switches and its head cond, each matched by its branch count and by running
    once per schedule time step; the head cond is the one holding collectives over `pipeline`
    (the stage branches never do: they would deadlock). [] when they cannot be told apart."""
    tables = _branch_tables(layout)
    steps = tables["fwd"][1].shape[0]
    with_pipeline = {
        name for c in compiled.collectives if PIPELINE in hlo.mesh_axes_of(c, compiled.mesh) for name, _ in c.branch
    }
    matched = {}
    for name, (count, runs) in compiled.conditionals.items():
        if runs != steps:
            continue
        if name in with_pipeline:
            if count != 2:
                return []
            matched[name] = tables["head"][1]
            continue
        fits = [t for key, (n, t) in tables.items() if key != "head" and n == count]
        # Equal branch counts: the forward and backward tables must then agree rank by rank.
        if not fits or any(not np.array_equal(_runs_per_rank(f, count), _runs_per_rank(fits[0], count)) for f in fits):
            return []
        matched[name] = fits[0]
    if not matched:
        return []
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
