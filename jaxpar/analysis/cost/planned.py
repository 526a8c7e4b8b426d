"""The unit of the analytic collective model: `Planned` (count collectives of one kind over
mesh axes, each of a size), the byte convention (`jaxpar.analysis.program.wire.wire_bytes`) and
`XlaLowering`, how the compiler turns the sharding into collectives."""

from __future__ import annotations

import dataclasses

from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.program.hlo import COLLECTIVE_PERMUTE
from jaxpar.analysis.program.wire import wire_bytes  # noqa: F401 (re-exported for the cost model)


@dataclasses.dataclass(frozen=True)
class XlaLowering:
    reduce_scatter_as_all_reduce: bool  # partitioner reduce-scatters stay all-reduce + slice
    attention_input_grad_all_reduces: int  # per layer backward: q, k, v partials reduced apart
    mlp_input_grad_all_reduces: int  # gate and up
    sp_backward_gathers: int  # per layer, SP: output-gradient gathers (one per use on CPU)
    table_grads_per_use: bool = False  # a table used twice (MTP's lookups and heads): each use's gradient reduced apart


IDEAL = XlaLowering(False, 1, 1, 2)
XLA_CPU = XlaLowering(True, 3, 2, 4, table_grads_per_use=True)


def lowering_for(layout: Layout) -> XlaLowering:
    return XLA_CPU if layout.target == "cpu" else IDEAL


@dataclasses.dataclass(frozen=True)
class Planned:
    """`count` collectives of one kind per step over `axes`, each moving `size` bytes."""

    kind: str
    axes: tuple[str, ...]
    size: float
    count: float
    what: str
    quirk: bool = False  # a known jaxpar inefficiency (see `jaxpar_quirks`)
    group_size: int = 0  # devices per group when smaller than the axes (0: all of them)
    overlap: bool = False  # XLA can run it behind compute (`jaxpar.analysis.cost.efficiency`, rule 3)

    def group(self, mesh: dict) -> int:
        if self.group_size:
            return self.group_size
        n = 1
        for a in self.axes:
            n *= mesh[a]
        return 2 if self.kind == COLLECTIVE_PERMUTE else n

    def wire_bytes(self, mesh: dict) -> float:
        return self.count * wire_bytes(self.kind, self.size, self.group(mesh))


def present_axes(layout: Layout, *names) -> tuple[str, ...]:
    return tuple(a for a in names if layout.mesh[a] > 1)
