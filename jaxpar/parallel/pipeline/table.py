"""A pipeline schedule table: the actions each pipeline rank runs at each time step, as data.

The SPMD engine runs a table inside `shard_map` over the `pipeline` axis as a scan over time
steps: at step t, rank r runs what cell `grid[t][r]` holds, then each activation moves to the rank
of the next stage and each gradient to the rank of the previous one. A value produced at step t
can be used by its receiver at step t + 1 or later (later means the receiver buffers it), also
when the receiver is the same rank.

Cells hold at most one forward-type action (F) and at most one backward-type action (B or W):
idle, F, B, W, F+B or F+W. Never B+W, never two of a kind.

Actions: F is one microbatch's forward through one stage. B is its backward: the full backward
when `split_backward` is False, or only the input gradient (what the previous stage waits for)
when it is True. W is the weight gradient of a split backward; nothing waits for it.

Stages: p ranks each hold v virtual stages, S = v * p global stages. A table carries its stage
map (`Schedule.stages`: global stage s -> (rank, local virtual stage)); actions name the local
index, `Schedule.global_stage` / `Schedule.locate` translate. `modular_stages` (the default) puts
s on rank s % p as local index s // p, so with v > 1 the last rank feeds rank 0 (a ring); any
bijection onto ranks x local indices is valid, e.g. a V shape (rank r holding stages r and
2p - 1 - r). `Schedule.hops` lists the rank distances the map's stage-to-stage transfers use: the
engine runs one `ppermute` per distance each way (none for distance 0).

Also here: the lockstep cost model (`step_costs`, `bubble_fraction`) and the text form (`render`
prints a grid, `parse` reads it back, so tests can state tables literally). Which tables exist
(builders and their records) is `schedules.py`; checks are `checks.py`; `slots.py` turns a table
into what the engine indexes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import numpy as np

F, B, W = "F", "B", "W"
KINDS = (F, B, W)
_KIND_ORDER = {kind: i for i, kind in enumerate(KINDS)}

StageMap = tuple[tuple[int, int], ...]  # (rank, local virtual stage) per global stage


def modular_stages(p: int, v: int) -> StageMap:
    """Global stage s = u * p + r on rank r as local virtual stage u (Megatron's interleaving)."""
    return tuple((s % p, s // p) for s in range(p * v))


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work: `kind` in F/B/W, microbatch `mb`, local virtual stage `vstage`."""

    kind: str
    mb: int
    vstage: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def is_forward(self) -> bool:
        return self.kind == F

    def label(self, show_vstage: bool = False) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.vstage}" if show_vstage else "")


Cell = tuple[Action, ...]


@dataclasses.dataclass(frozen=True)
class Hop:
    """Stage-to-stage transfers over one rank distance d = (rank(s + 1) - rank(s)) mod p: the
    (sender, receiver) rank pairs of activations; gradients go the reverse way. d = 0 stays on
    the rank (no pairs)."""

    distance: int
    pairs: tuple  # ((rank(s), rank(s + 1)), ...) sorted, each rank at most once per side


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: `grid[t][r]` is the cell (tuple of Actions) rank r runs at step t, and
    `stages[s]` the (rank, local virtual stage) of global stage s (default `modular_stages`)."""

    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    split_backward: bool
    grid: tuple[tuple[Cell, ...], ...]
    stages: StageMap | None = None

    def __post_init__(self):  # accept nested lists; store nested tuples
        object.__setattr__(self, "grid", tuple(tuple(tuple(cell) for cell in row) for row in self.grid))
        p, v = self.num_ranks, self.virtual_stages
        stages = modular_stages(p, v) if self.stages is None else tuple(tuple(int(x) for x in e) for e in self.stages)
        if sorted(stages) != [(r, u) for r in range(p) for u in range(v)]:
            raise ValueError(f"stages={stages} must place the {p * v} stages on every (rank < {p}, vstage < {v}) once")
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "_index", {place: s for s, place in enumerate(stages)})

    @property
    def num_steps(self) -> int:
        return len(self.grid)

    @property
    def num_stages(self) -> int:
        return self.virtual_stages * self.num_ranks

    def global_stage(self, rank: int, vstage: int) -> int:
        return self._index[(rank, vstage)]

    def locate(self, stage: int) -> tuple[int, int]:
        """(rank, local virtual stage) of global stage `stage`."""
        return self.stages[stage]

    @property
    def modular(self) -> bool:
        return self.stages == modular_stages(self.num_ranks, self.virtual_stages)

    @property
    def hops(self) -> tuple[Hop, ...]:
        """The distinct rank distances of the stage-to-stage transfers, ascending."""
        p, pairs = self.num_ranks, {}
        for s in range(self.num_stages - 1):
            a, b = self.stages[s][0], self.stages[s + 1][0]
            pairs.setdefault((b - a) % p, set()).add((a, b))
        return tuple(Hop(d, tuple(sorted(x)) if d else ()) for d, x in sorted(pairs.items()))

    def __str__(self) -> str:
        return render(self)


def check_sizes(p, m, v=1) -> None:
    for flag, value in (("num_ranks", p), ("num_microbatches", m), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def from_placements(name, p, m, v, split, placements: Iterable[tuple[int, int, Action]], stages=None) -> Schedule:
    """A table from (step, rank, Action) placements; each cell's actions in F, B, W order."""
    placements = list(placements)
    cells = [[[] for _ in range(p)] for _ in range(1 + max(t for t, _, _ in placements))]
    for t, r, action in placements:
        cells[t][r].append(action)
    for row in cells:
        for cell in row:
            if len(cell) > 1:
                cell.sort(key=lambda a: _KIND_ORDER[a.kind])
    return Schedule(name, p, m, v, split, cells, stages)


def action_cost(kind: str, split_backward: bool) -> int:
    """F = 1; B = 2 (full backward) or 1 (input grad only); W = 1."""
    return 2 if kind == B and not split_backward else 1


def step_costs(schedule: Schedule) -> np.ndarray:
    """Duration of each step: the max over ranks of the summed cost of that rank's cell."""
    split = schedule.split_backward
    return np.array(
        [max(sum(action_cost(a.kind, split) for a in cell) for cell in row) for row in schedule.grid],
        dtype=np.int64,
    )


def bubble_fraction(schedule: Schedule) -> float:
    """Idle fraction of the table under a lockstep cost model.

    Costs: F = 1 and B = 2 when the backward is whole, F = B = W = 1 when it is split; a cell
    costs the sum of its actions (F+B = 3). All ranks wait for each other every step, so a step
    lasts as long as its most expensive cell, and total time is the sum of step durations.
    bubble = 1 - (mean useful work per rank) / (total time). With virtual stages the unit is one
    chunk (1/v of a rank's layers); the fraction is unit-free.
    """
    total = int(step_costs(schedule).sum())
    if total == 0:
        raise ValueError(f"schedule {schedule.name!r} has no work")
    split = schedule.split_backward
    work = [0] * schedule.num_ranks
    for row in schedule.grid:
        for r, cell in enumerate(row):
            work[r] += sum(action_cost(a.kind, split) for a in cell)
    return 1.0 - (sum(work) / schedule.num_ranks) / total


def _cell_label(cell: Cell, show_vstage: bool) -> str:
    return "".join(a.label(show_vstage) for a in cell) or "."


def render(schedule: Schedule) -> str:
    """The grid as text: one row per rank, one column per step, then each step's cost. The header
    names the stage map (`stages=rank.vstage,...` per global stage) unless it is `modular_stages`."""
    show_v = schedule.virtual_stages > 1
    labels = [[_cell_label(cell, show_v) for cell in row] for row in schedule.grid]
    costs = step_costs(schedule)
    columns = [[str(t), *labels[t], str(costs[t])] for t in range(schedule.num_steps)]
    widths = [max(len(x) for x in col) for col in columns]
    names = ["step", *(f"r{r}" for r in range(schedule.num_ranks)), "cost"]
    head = max(len(x) for x in names)
    split = ", B split into B (input grad) + W (weight grad)" if schedule.split_backward else ""
    stages = "" if schedule.modular else " stages=" + ",".join(f"{r}.{u}" for r, u in schedule.stages)
    lines = [
        f"{schedule.name}: p={schedule.num_ranks} m={schedule.num_microbatches} "
        f"v={schedule.virtual_stages}{stages}, {schedule.num_steps} steps{split}"
    ]
    for k, name in enumerate(names):
        lines.append(" ".join([name.ljust(head)] + [col[k].rjust(w) for col, w in zip(columns, widths)]))
    return "\n".join(lines)


_HEADER = re.compile(r"^(\S+): p=(\d+) m=(\d+) v=(\d+)(?: stages=([\d.,]+))?, (\d+) steps(, B split.*)?$")
_ACTION = re.compile(r"([FBW])(\d+)(?:\.(\d+))?")


def parse(text: str) -> Schedule:
    """The inverse of `render`: a Schedule from its printed grid (the `cost` row is ignored).

    Cells are `.` (idle) or concatenated actions such as `F3`, `F3B1`, or `F3.1B0.0` (microbatch
    `.` virtual stage) when v > 1. A header without `stages=` means `modular_stages`.
    """
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    head = _HEADER.match(lines[0].strip())
    if not head:
        raise ValueError(f"not a schedule header: {lines[0]!r}")
    name, p, m, v, stages, steps, split = head.groups()
    p, m, v, steps = int(p), int(m), int(v), int(steps)
    if stages is not None:
        stages = tuple(tuple(int(x) for x in e.split(".")) for e in stages.split(","))
    grid = [[() for _ in range(p)] for _ in range(steps)]
    for r in range(p):
        row = next((line.split() for line in lines[1:] if line.split()[0] == f"r{r}"), None)
        if row is None or len(row) != steps + 1:
            raise ValueError(f"rank r{r}: expected a row with {steps} cells")
        for t, label in enumerate(row[1:]):
            if label == ".":
                continue
            actions = _ACTION.findall(label)
            if "".join(f"{k}{mb}" + (f".{u}" if u else "") for k, mb, u in actions) != label:
                raise ValueError(f"step {t}, rank r{r}: cannot read cell {label!r}")
            grid[t][r] = tuple(Action(k, int(mb), int(u or 0)) for k, mb, u in actions)
    return Schedule(name, p, m, v, bool(split), grid, stages)
