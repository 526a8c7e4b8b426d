"""The byte convention every collective is counted in, compiled or modelled: what one participating
device sends (`jaxpar.analysis.cost.comm` explains the choice). It lives with the program reader so
that reading a compiled program never needs the cost model."""

from __future__ import annotations

from jaxpar.analysis.program.hlo import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER


def wire_bytes(kind: str, size: float, group: int) -> float:
    """Bytes one participating device sends for one collective of `size` over `group` devices."""
    if group <= 1:
        return 0.0
    if kind == ALL_REDUCE:
        return 2 * (group - 1) / group * size
    if kind == COLLECTIVE_PERMUTE:
        return float(size)
    if kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (group - 1) / group * size
    raise ValueError(f"unknown collective kind {kind!r}")
