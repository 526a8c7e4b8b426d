"""Checks for pipeline schedule tables: `validate` (dependencies, coverage, cell shape) and
`peak_in_flight` (stash depth per rank), for any stage map. See `schedules.py` for the table
semantics.
"""

from __future__ import annotations

import numpy as np

from jaxpar.parallel.pipeline.table import KINDS, Action, B, F, Schedule, W

_MAX_SHOWN = 8


def _name(kind: str, mb: int, stage: int) -> str:
    return f"{kind}(mb={mb}, stage={stage})"


def _where(place: tuple[int, int]) -> str:
    return f"step {place[0]}, rank {place[1]}"


def _problems(s: Schedule) -> list[str]:
    p, m, v = s.num_ranks, s.num_microbatches, s.virtual_stages
    if min(p, m, v) < 1:
        return [f"num_ranks, num_microbatches, virtual_stages must be >= 1, got {p}, {m}, {v}"]
    problems = []
    for t, row in enumerate(s.grid):
        if len(row) != p:
            problems.append(f"step {t} has {len(row)} cells, expected one per rank ({p})")
    if problems:
        return problems

    kinds = KINDS if s.split_backward else (F, B)
    stage_of = {place: stage for stage, place in enumerate(s.stages)}  # `Schedule.global_stage`, inlined
    seen: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for t, row in enumerate(s.grid):
        for r, cell in enumerate(row):
            if not cell:
                continue
            good = []
            for a in cell:
                if not isinstance(a, Action):
                    problems.append(f"step {t}, rank {r}: {a!r} is not an Action")
                elif a.kind not in kinds:
                    problems.append(f"step {t}, rank {r}: {a.kind} action but split_backward is False")
                elif not (0 <= a.mb < m and 0 <= a.vstage < v):
                    problems.append(
                        f"step {t}, rank {r}: {a.kind} mb={a.mb} vstage={a.vstage} is outside "
                        f"mb < {m}, vstage < {v}"
                    )
                else:
                    good.append(a)
                    seen.setdefault((a.kind, a.mb, stage_of[(r, a.vstage)]), []).append((t, r))
            if len(good) < 2:  # one action: nothing to label
                continue
            fwd = [a.label(v > 1) for a in good if a.is_forward]
            bwd = [a.label(v > 1) for a in good if not a.is_forward]
            if len(fwd) > 1:
                problems.append(f"step {t}, rank {r}: {len(fwd)} forward actions {'+'.join(fwd)} in one cell")
            if len(bwd) > 1:
                problems.append(
                    f"step {t}, rank {r}: {len(bwd)} backward-type actions {'+'.join(bwd)} in one cell"
                    " (at most one of B/W)"
                )

    when: dict[tuple[str, int, int], tuple[int, int]] = {}
    for kind in kinds:
        for mb in range(m):
            for stage in range(s.num_stages):
                places = seen.get((kind, mb, stage), [])
                if not places:
                    problems.append(f"{_name(kind, mb, stage)} is missing (rank {s.locate(stage)[0]})")
                elif len(places) > 1:
                    at = "; ".join(_where(x) for x in places)
                    problems.append(f"{_name(kind, mb, stage)} appears {len(places)} times: {at}")
                else:
                    when[(kind, mb, stage)] = places[0]

    def needs(after: tuple, before: tuple, why: str) -> None:
        if after in when and before in when and when[after][0] <= when[before][0]:
            problems.append(
                f"{_name(*after)} at {_where(when[after])} must come at least one step after "
                f"{_name(*before)} at {_where(when[before])} ({why})"
            )

    if len(when) == len(kinds) * m * s.num_stages and _in_order(when, kinds, m, s.num_stages):
        return problems  # the line-by-line checks below would find nothing (they were half of `validate`)
    last = s.num_stages - 1
    transfer = "sent at step t, usable at t+1"
    for mb in range(m):
        for stage in range(s.num_stages):
            if stage > 0:
                needs((F, mb, stage), (F, mb, stage - 1), f"it consumes that output, {transfer}")
            needs((B, mb, stage), (F, mb, stage), "backward before its own forward")
            if stage < last:
                needs((B, mb, stage), (B, mb, stage + 1), f"it consumes that gradient, {transfer}")
            if s.split_backward:
                needs((W, mb, stage), (B, mb, stage), "weight gradient needs the output gradient from B")
    return problems


def _in_order(when: dict, kinds: tuple, m: int, num_stages: int) -> bool:
    """Every dependency `_problems` checks holds, for a table with each action exactly once
    (`when`: (kind, mb, global stage) -> (step, rank)), as array comparisons."""
    t = np.array([when[(kind, mb, stage)][0] for kind in kinds for mb in range(m) for stage in range(num_stages)])
    t = t.reshape(len(kinds), m, num_stages)
    f, b = t[0], t[1]
    ok = (f[:, 1:] > f[:, :-1]).all() and (b > f).all() and (b[:, :-1] > b[:, 1:]).all()
    return bool(ok and (len(kinds) < 3 or (t[2] > b).all()))


def validate(schedule: Schedule) -> None:
    """Raises ValueError listing what is wrong with `schedule`, or returns None.

    Checks: one cell per rank each step; F and B (and W when split) of every (microbatch, global
    stage, placed by the table's stage map) exactly once; F of stage s at least one step after F
    of stage s - 1 (a value sent at step t is usable at t + 1, also between stages on one rank);
    B after its own F (the last stage's loss gradient is local, but still the step after); B of
    stage s at least one step after B of stage s + 1; W after its B; at most one forward-type (F)
    and one backward-type (B or W) action per cell.
    """
    problems = _problems(schedule)
    if problems:
        s = schedule
        head = (
            f"invalid pipeline schedule {s.name!r} (p={s.num_ranks}, m={s.num_microbatches}, "
            f"v={s.virtual_stages}): {len(problems)} problem(s)"
        )
        shown = problems[:_MAX_SHOWN]
        more = [f"... and {len(problems) - _MAX_SHOWN} more"] if len(problems) > _MAX_SHOWN else []
        raise ValueError("\n  ".join([head] + shown + more))


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (microbatch, virtual stage) stashes held at once.

    A stash is taken by F and released by the last backward-type action of that microbatch and
    stage: B, or W when the backward is split (W still needs the stage's inputs). Counted at
    step boundaries, i.e. a cell's B/W may free its stash for the same cell's F (in a scan the
    B reads the carried stash before the F writes). Add 1 where an engine cannot reuse it.
    """
    release = W if schedule.split_backward else B
    live = [0] * schedule.num_ranks
    peak = [0] * schedule.num_ranks
    for row in schedule.grid:
        for r, cell in enumerate(row):
            for a in cell:
                live[r] += 1 if a.kind == F else -1 if a.kind == release else 0
            peak[r] = max(peak[r], live[r])
    return peak
