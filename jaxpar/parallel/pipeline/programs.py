"""Tables from per-rank programs: each rank's ordered list of work, laid out as early as the
dependencies allow under any stage map (`from_programs`). The builders of zb_h1, zb_v and
dualpipev (`schedules.py`, `vshape.py`) state their schedules this way.
"""

from __future__ import annotations

from jaxpar.parallel.pipeline.table import Action, B, F, Schedule, StageMap, check_sizes, from_placements, modular_stages


def from_programs(name: str, p: int, m: int, v: int, programs, *, split_backward: bool = False,
                  stages: StageMap | None = None) -> Schedule:
    """A table from each rank's ordered program: a list of items per rank, an item being one
    Action or a tuple of Actions that share a cell (one F with one B or W, e.g. DualPipeV's
    overlapped F&B). Every step, each rank runs its next item if all the values its actions need
    were produced at an earlier step. Dependencies follow the stage map: F(s) after F(s - 1), B(s)
    after B(s + 1) (the last stage's after its own F), W after its B. Raises when no rank can move
    (a program order that contradicts the dependencies)."""
    check_sizes(p, m, v)
    stages = modular_stages(p, v) if stages is None else stages
    index = {tuple(place): s for s, place in enumerate(stages)}
    last = p * v - 1
    done: set[tuple[str, int, int]] = set()  # (kind, mb, global stage) finished at an earlier step
    # Each item's actions with their global stages, looked up once rather than every step it waits.
    programs = [
        [tuple((a, index[(r, a.vstage)]) for a in (item if isinstance(item, tuple) else (item,))) for item in program]
        for r, program in enumerate(programs)
    ]
    pos = [0] * p
    placements = []

    def ready(a: Action, s: int) -> bool:
        if a.kind == F:
            return s == 0 or (F, a.mb, s - 1) in done
        if a.kind == B:
            return (B, a.mb, s + 1) in done if s < last else (F, a.mb, s) in done
        return (B, a.mb, s) in done

    t, left = 0, sum(map(len, programs))
    while left:
        runs = []
        for r in range(p):
            if pos[r] == len(programs[r]):
                continue
            item = programs[r][pos[r]]
            if all(ready(a, s) for a, s in item):
                runs.append((r, item))
        if not runs:
            raise RuntimeError(f"{name}(p={p}, m={m}): programs deadlocked at step {t}")
        for r, item in runs:
            for a, s in item:
                done.add((a.kind, a.mb, s))
                placements.append((t, r, a))
            pos[r] += 1
        left -= len(runs)
        t += 1
    return from_placements(name, p, m, v, split_backward, placements, stages)
