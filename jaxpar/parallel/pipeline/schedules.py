"""The pipeline schedules the engine runs, as records: one `ScheduleKind` per schedule in the tuple
`SCHEDULES` (no registry), looked up by name with `schedule_kind`.

A record holds the schedule's builder (p, m, v) -> table (`table.py`), the virtual stages it
takes, its microbatch constraints (one-line problems naming the config keys, read by preflight),
its textbook bubble formula, whether its backward is split, and its stage -> rank map (the one its
tables carry). The builders: `gpipe`, `one_f_one_b`, `interleaved_1f1b`, `zb_h1` here; the
V-shaped `zb_v` and `dualpipev` in `vshape.py`; `from_programs` (`programs.py`, re-exported) lays
out per-rank programs as early as their dependencies allow under any stage map.

`make_schedule`, `theoretical_bubble` and `SCHEDULE_NAMES` are thin wrappers over the records for
callers that still pass names; `bubble_fraction` is re-exported from `table.py` for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline.programs import from_programs
from jaxpar.parallel.pipeline.table import (  # noqa: F401  (bubble_fraction: see the docstring)
    Action,
    B,
    F,
    Schedule,
    StageMap,
    W,
    bubble_fraction,
    check_sizes,
    from_placements,
    modular_stages,
)
from jaxpar.parallel.pipeline.vshape import _dualpipev_constraints, dualpipev, v_stages, zb_v


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (full B).

    F(i) on rank r at step i + r; B(i) on rank r at step (m + p - 1) + i + (p - 1 - r).
    m + p - 1 forward steps (cost 1) and m + p - 1 backward steps (cost 2): total 3(m + p - 1),
    bubble (p - 1) / (m + p - 1). Every rank stashes all m microbatches.
    """
    check_sizes(p, m)
    fill = m + p - 1
    placements = []
    for i in range(m):
        for r in range(p):
            placements.append((i + r, r, Action(F, i)))
            placements.append((fill + i + (p - 1 - r), r, Action(B, i)))
    return from_placements("gpipe", p, m, 1, False, placements)


def _circular(name: str, p: int, m: int, v: int) -> Schedule:
    # Microbatch i = g * p + j (group g, slot j). Forward order on a rank: for each group, each
    # virtual stage u, the group's p microbatches; backward order: the same with u reversed.
    # Every hop (including rank p-1 -> rank 0 between virtual stages) takes exactly one step.
    placements = []
    for i in range(m):
        g, j = divmod(i, p)
        for u in range(v):
            for r in range(p):
                placements.append((g * p * v + u * p + j + r, r, Action(F, i, u)))
                back = v * p + g * p * v + (v - 1 - u) * p + j + (p - 1 - r)
                placements.append((back, r, Action(B, i, u)))
    return from_placements(name, p, m, v, False, placements)


def one_f_one_b(p: int, m: int) -> Schedule:
    """Lockstep 1F1B with overlapped F+B cells (full B).

    F(i) on rank r at step i + r, B(i) at step i + 2p - 1 - r: rank r runs 2(p - r) - 1 warm-up
    forwards, then one F+B per step, then its remaining B's. Steps 0..p-1 cost 1, the next m - 1
    cost 3 (F+B on the last rank), the last p cost 2: total 3(m + p - 1), bubble
    (p - 1) / (m + p - 1), the same as GPipe.

    Stash on rank r: min(m, 2(p - r) - 1), not the p - r of an MPMD 1F1B. In lockstep a
    microbatch needs 2(p - r) - 1 steps to come back to rank r, and a rank that is busy in every
    steady step starts a new forward in each of them. Capping the stash at p - r leaves ranks
    idle in steady steps that cost 3, so the bubble no longer shrinks as m grows.
    """
    check_sizes(p, m)
    return _circular("1f1b", p, m, 1)


def _interleaved_constraints(p: int, m: int, v: int) -> list[str]:
    if m % p:
        return [f"parallel.num_microbatches={m} must be a multiple of mesh.{PIPELINE}={p} for interleaved_1f1b"]
    return []


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved (Megatron-order) 1F1B with v virtual stages per rank, lockstep, full B.

    Microbatch i = g * p + j, virtual stage u on rank r:
      F at step g*p*v + u*p + j + r,   B at step v*p + g*p*v + (v-1-u)*p + j + (p-1-r).
    Steps 0..vp-1 cost 1, the next mv + p - 1 - vp cost 3, the last vp cost 2: total
    3(mv + p - 1) chunk units, bubble (p - 1) / (vm + p - 1). Stash on rank r:
    min(mv, (v - 1)p + 2(p - r) - 1) chunk activations, as in Megatron's warm-up.
    """
    check_sizes(p, m, v)
    if problems := _interleaved_constraints(p, m, v):
        raise ValueError(problems[0])
    return _circular("interleaved_1f1b", p, m, v)


def _zb_h1_program(p: int, m: int, r: int) -> list[Action]:
    warmup = min(m, p - 1 - r)
    program = [Action(F, i) for i in range(warmup)]
    n_f, n_b, n_w = warmup, 0, 0
    while n_b < m:
        if n_f < m:
            program.append(Action(F, n_f))
            n_f += 1
        program.append(Action(B, n_b))
        n_b += 1
        if n_b - n_w > r:  # rank r keeps r weight gradients pending
            program.append(Action(W, n_w))
            n_w += 1
    return program + [Action(W, i) for i in range(n_w, m)]


def zb_h1(p: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2023): split B (input grad) and W (weight grad), F = B = W = 1.

    Rank r's program: min(m, p - 1 - r) warm-up F's, then repeated F, B, with W(k) added once more
    than r W's are pending (so every rank holds up to p microbatches, rank 0's 1F1B peak), then
    the pending W's, which fill the cool-down bubble. Each program is laid out as early as its
    dependencies allow (`from_programs`), one action per cell, so every step costs 1 and total
    time is the number of steps. For m >= p that is 3m + p - 1, bubble (p - 1) / (3m + p - 1);
    for m < p it is 2m + 2p - 1.
    """
    check_sizes(p, m)
    programs = [_zb_h1_program(p, m, r) for r in range(p)]
    return from_programs("zb_h1", p, m, 1, programs, split_backward=True)


def _no_constraints(p: int, m: int, v: int) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """One schedule the engine can run: how to build its table and what it accepts.

    `build(p, m, v)` gets sizes already checked against `virtual_stages` and `constraints`;
    `constraints(p, m, v)` returns one line per problem, naming the config keys to change (used
    by preflight, `options.checks`); `bubble(p, m, v)` is the textbook bubble fraction; `stages(p,
    v)` the stage -> (rank, local virtual stage) map its tables carry; `default_virtual_stages` the
    v a run gets when `parallel.virtual_stages` is 0; `searched` whether the planner tries it."""

    name: str
    build: Callable[[int, int, int], Schedule]
    bubble: Callable[[int, int, int], float]
    split_backward: bool = False
    virtual_stages: tuple | None = (1,)  # the v it builds; None: any v >= 1
    constraints: Callable[[int, int, int], list] = _no_constraints
    stages: Callable[[int, int], StageMap] = modular_stages
    default_virtual_stages: int = 1
    searched: bool = True

    def __post_init__(self):
        if not self.accepts(self.default_virtual_stages):
            raise AssertionError(f"{self.name}: default_virtual_stages={self.default_virtual_stages} is not a v it builds")

    def resolve_virtual_stages(self, v: int) -> int:
        """`parallel.virtual_stages` as this schedule runs it: 0 is the schedule's own."""
        return v or self.default_virtual_stages

    def accepts(self, v: int) -> bool:
        return self.virtual_stages is None or v in self.virtual_stages

    def virtual_stage_problem(self, v: int) -> str | None:
        """The one-line problem when this schedule does not take v virtual stages, else None."""
        if self.accepts(v):
            return None
        if 1 not in self.virtual_stages:  # a V shape: the stage map fixes v
            takes = " or ".join(map(str, self.virtual_stages))
            return f"parallel.virtual_stages={v} must be {takes} for parallel.pipeline_schedule={self.name!r}"
        others = " or ".join(repr(k.name) for k in SCHEDULES if k.accepts(v)) or "a schedule that takes it"
        takes = " or ".join(map(str, self.virtual_stages))
        return f"parallel.virtual_stages={v} needs parallel.pipeline_schedule={others} ({self.name!r} takes {takes})"

    def problems(self, p: int, m: int, v: int = 1) -> list[str]:
        problem = self.virtual_stage_problem(v)
        return [problem] if problem else list(self.constraints(p, m, v))

    def table(self, p: int, m: int, v: int = 1) -> Schedule:
        """The table for p ranks, m microbatches, v virtual stages; ValueError when they do not fit."""
        check_sizes(p, m, v)
        if problems := self.problems(p, m, v):
            raise ValueError(f"pipeline schedule {self.name!r}: " + "; ".join(problems))
        table = self.build(p, m, v)
        if table.stages != self.stages(p, v) or table.split_backward != self.split_backward:
            raise AssertionError(f"{self.name}: the built table does not match its record")
        return table


# Builders and textbook bubbles as (p, m, v) functions: module-level, so records pickle.
def _gpipe(p, m, v):
    return gpipe(p, m)


def _one_f_one_b(p, m, v):
    return one_f_one_b(p, m)


def _zb_h1(p, m, v):
    return zb_h1(p, m)


def _zb_v(p, m, v):
    return zb_v(p, m)


def _dualpipev(p, m, v):
    return dualpipev(p, m)


def _zb_v_constraints(p, m, v):
    if m < p:
        return [f"parallel.num_microbatches={m} must be at least mesh.{PIPELINE}={p} for zb_v"]
    return []


def _plain_bubble(p, m, v):
    return (p - 1) / (m + p - 1)


def _interleaved_bubble(p, m, v):
    return (p - 1) / (v * m + p - 1)


def _zb_h1_bubble(p, m, v):
    # Qi et al.: (p - 1)(T_F + T_B - T_W); with T_F = T_B = T_W = 1 (this module's split costs)
    # p - 1 units against 3m of work per rank. It assumes m >= p.
    return (p - 1) / (3 * m + p - 1)


def _v_bubble(p, m, v):
    # ZB-V (Qi et al.) and DualPipeV (DeepSeek-V3: (PP/2 - 1)(F&B + B - 3W)) are bubble-free within
    # their parallelogram at F = B = W (F&B = F + B); what a synchronous step still pays is the
    # start-up skew: the last rank waits p - 1 chunk steps for the first microbatch, against 6m
    # units of work per rank (2 chunks x F, B, W per microbatch). See `vshape.py`.
    return (p - 1) / (6 * m + p - 1)


SCHEDULES = (
    # Never searched by the planner: the bubble of 1f1b with all m microbatches' activations stashed
    # (1f1b stashes at most 2(p - r) - 1), so it never wins.
    ScheduleKind("gpipe", _gpipe, _plain_bubble, searched=False),
    ScheduleKind("1f1b", _one_f_one_b, _plain_bubble),
    # Any v; 2 unless told, since interleaving is what it is chosen for (v = 1 is 1f1b).
    ScheduleKind(
        "interleaved_1f1b", interleaved_1f1b, _interleaved_bubble, virtual_stages=None,
        constraints=_interleaved_constraints, default_virtual_stages=2,
    ),
    ScheduleKind("zb_h1", _zb_h1, _zb_h1_bubble, split_backward=True),
    ScheduleKind(
        "zb_v", _zb_v, _v_bubble, split_backward=True, virtual_stages=(2,), constraints=_zb_v_constraints,
        stages=v_stages, default_virtual_stages=2,
    ),
    ScheduleKind(
        "dualpipev", _dualpipev, _v_bubble, split_backward=True, virtual_stages=(2,),
        constraints=_dualpipev_constraints, stages=v_stages, default_virtual_stages=2,
    ),
)
SCHEDULE_NAMES = tuple(k.name for k in SCHEDULES)


def schedule_kind(name: str | ScheduleKind) -> ScheduleKind:
    """The record called `name` (a record is returned as it is)."""
    if isinstance(name, ScheduleKind):
        return name
    for kind in SCHEDULES:
        if kind.name == name:
            return kind
    raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULE_NAMES)}")


def make_schedule(name: str | ScheduleKind, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` for p ranks, m microbatches and v virtual stages per rank."""
    return schedule_kind(name).table(p, m, v)


def theoretical_bubble(name: str | ScheduleKind, p: int, m: int, v: int = 1) -> float:
    """Textbook bubble fraction (idle time over total time), the record's `bubble`:
    gpipe, 1f1b: (p - 1) / (m + p - 1); interleaved_1f1b: (p - 1) / (v*m + p - 1);
    zb_h1: (p - 1) / (3m + p - 1); zb_v, dualpipev: (p - 1) / (6m + p - 1)."""
    check_sizes(p, m, v)
    kind = schedule_kind(name)
    if problem := kind.virtual_stage_problem(v):
        raise ValueError(problem)
    return kind.bubble(p, m, v)
