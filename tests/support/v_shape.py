"""V-shaped pipeline tables in orders no library schedule uses, for the stage-map tests: rank r
holds stages r and 2p - 1 - r (`vshape.v_stages`, v = 2), so stage 0 and the last stage both sit
on rank 0 and the hops use rank distances +1, 0 (on rank p - 1) and -1. (The library's V records
are `zb_v` and `dualpipev`.)

`v_table` lays out per-rank programs with `programs.from_programs`, each rank's actions ordered by
a key that grows along every dependency (so the layout cannot deadlock), full or split backward,
in a 1F1B-like or a GPipe order; `v_kind` wraps it as a `ScheduleKind` for the engine tests.
"""

from __future__ import annotations

import functools

from jaxpar.parallel.pipeline.programs import from_programs
from jaxpar.parallel.pipeline.schedules import ScheduleKind
from jaxpar.parallel.pipeline.table import Action, B, F, W
from jaxpar.parallel.pipeline.vshape import v_stages


def _key(order: str, kind: str, mb: int, s: int, S: int) -> tuple:
    """A sort key that grows along every dependency (F(s-1) < F(s) < ... < B(s) < W(s))."""
    if order == "1f1b":  # lockstep 1F1B-like: F(i, s) around step i + s, B(i, s) around i + 2S - 1 - s
        return {F: (mb + s, 1, 0), B: (mb + 2 * S - 1 - s, 0, 0), W: (mb + 2 * S - s, 2, 0)}[kind]
    # "gpipe": every forward, then the backwards (W right after its B)
    return {F: (0, s, mb, 0), B: (1, S - 1 - s, mb, 0), W: (1, S - 1 - s, mb, 1)}[kind]


def v_table(p: int, m: int, *, split_backward: bool = False, order: str = "1f1b", name: str = "v_test"):
    stages = v_stages(p)
    S = len(stages)
    kinds = (F, B, W) if split_backward else (F, B)
    programs = []
    for r in range(p):
        mine = [(s, u) for s, (rank, u) in enumerate(stages) if rank == r]
        actions = [(_key(order, k, mb, s, S), Action(k, mb, u)) for s, u in mine for mb in range(m) for k in kinds]
        programs.append([a for _, a in sorted(actions, key=lambda x: x[0])])
    return from_programs(name, p, m, 2, programs, split_backward=split_backward, stages=stages)


def v_kind(*, split_backward: bool = False, order: str = "1f1b") -> ScheduleKind:
    """A record for `v_table`, to hand to `PipelineOptions` (not reachable from the config)."""
    build = functools.partial(_build, split_backward=split_backward, order=order)
    return ScheduleKind(f"v_{order}", build, lambda p, m, v: float("nan"), split_backward=split_backward,
                        virtual_stages=(2,), default_virtual_stages=2, stages=v_stages)


def _build(p, m, v, *, split_backward, order):
    return v_table(p, m, split_backward=split_backward, order=order, name=f"v_{order}")
