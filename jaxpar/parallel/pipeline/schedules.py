"""Pipeline schedules as data: a static table of actions per (time step, pipeline rank).

The SPMD engine runs a schedule inside `shard_map` over the `pipeline` axis as a scan over time
steps: at step t, rank r runs what cell `grid[t][r]` holds, then activations move one rank forward
and gradients one rank backward with one `ppermute` each. A value produced at step t can be used by
the neighbour at step t + 1 or later (later means the receiver buffers it).

Cells hold at most one forward-type action (F) and at most one backward-type action (B or W):
idle, F, B, W, F+B or F+W. Never B+W, never two of a kind.

Actions: F is one microbatch's forward through one stage. B is its backward: the full backward
when `split_backward` is False, or only the input gradient (what the previous stage waits for)
when it is True. W is the weight gradient of a split backward; nothing waits for it.

Stages: p ranks each hold v virtual stages, S = v * p global stages. Local virtual stage u on
rank r is global stage s = u * p + r (rank s % p, local index s // p), so stage s feeds stage s + 1
on rank (r + 1) % p. With v > 1 the last rank feeds rank 0, so both ppermutes are rings.

`render` prints a table as a grid and `parse` reads such a grid back, so tests can state tables
literally. Checks (`validate`, `peak_in_flight`) live in `checks.py`; `slots.py` turns a table
into what the engine indexes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

import numpy as np

F, B, W = "F", "B", "W"
KINDS = (F, B, W)
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


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
class Schedule:
    """A pipeline schedule: `grid[t][r]` is the cell (tuple of Actions) rank r runs at step t."""

    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    split_backward: bool
    grid: tuple[tuple[Cell, ...], ...]

    def __post_init__(self):  # accept nested lists; store nested tuples
        object.__setattr__(self, "grid", tuple(tuple(tuple(cell) for cell in row) for row in self.grid))

    @property
    def num_steps(self) -> int:
        return len(self.grid)

    @property
    def num_stages(self) -> int:
        return self.virtual_stages * self.num_ranks

    def global_stage(self, rank: int, vstage: int) -> int:
        return vstage * self.num_ranks + rank

    def __str__(self) -> str:
        return render(self)


def _check_sizes(p, m, v=1) -> None:
    for flag, value in (("num_ranks", p), ("num_microbatches", m), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def _build(name, p, m, v, split, placements: Iterable[tuple[int, int, Action]]) -> Schedule:
    placements = list(placements)
    cells = [[[] for _ in range(p)] for _ in range(1 + max(t for t, _, _ in placements))]
    for t, r, action in placements:
        cells[t][r].append(action)
    for row in cells:
        for cell in row:
            cell.sort(key=lambda a: KINDS.index(a.kind))
    return Schedule(name, p, m, v, split, cells)


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (full B).

    F(i) on rank r at step i + r; B(i) on rank r at step (m + p - 1) + i + (p - 1 - r).
    m + p - 1 forward steps (cost 1) and m + p - 1 backward steps (cost 2): total 3(m + p - 1),
    bubble (p - 1) / (m + p - 1). Every rank stashes all m microbatches.
    """
    _check_sizes(p, m)
    fill = m + p - 1
    placements = []
    for i in range(m):
        for r in range(p):
            placements.append((i + r, r, Action(F, i)))
            placements.append((fill + i + (p - 1 - r), r, Action(B, i)))
    return _build("gpipe", p, m, 1, False, placements)


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
    return _build(name, p, m, v, False, placements)


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
    _check_sizes(p, m)
    return _circular("1f1b", p, m, 1)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved (Megatron-order) 1F1B with v virtual stages per rank, lockstep, full B.

    Microbatch i = g * p + j, virtual stage u on rank r:
      F at step g*p*v + u*p + j + r,   B at step v*p + g*p*v + (v-1-u)*p + j + (p-1-r).
    Steps 0..vp-1 cost 1, the next mv + p - 1 - vp cost 3, the last vp cost 2: total
    3(mv + p - 1) chunk units, bubble (p - 1) / (vm + p - 1). Stash on rank r:
    min(mv, (v - 1)p + 2(p - r) - 1) chunk activations, as in Megatron's warm-up.
    """
    _check_sizes(p, m, v)
    if m % p:
        raise ValueError(f"interleaved_1f1b needs num_microbatches % num_ranks == 0, got m={m}, p={p}")
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
    dependencies allow, one action per cell, so every step costs 1 and total time is the number
    of steps. For m >= p that is 3m + p - 1, bubble (p - 1) / (3m + p - 1); for m < p it is
    2m + 2p - 1.
    """
    _check_sizes(p, m)
    programs = [_zb_h1_program(p, m, r) for r in range(p)]
    done: set[tuple[str, int, int]] = set()  # (kind, mb, rank) finished at an earlier step
    pos = [0] * p
    placements = []
    t = 0
    while any(pos[r] < len(programs[r]) for r in range(p)):
        runs = []
        for r in range(p):
            if pos[r] == len(programs[r]):
                continue
            a = programs[r][pos[r]]
            if a.kind == F:
                ready = r == 0 or (F, a.mb, r - 1) in done
            elif a.kind == B:
                ready = (B, a.mb, r + 1) in done if r < p - 1 else (F, a.mb, r) in done
            else:
                ready = (B, a.mb, r) in done
            if ready:
                runs.append((r, a))
        if not runs:
            raise RuntimeError(f"zb_h1(p={p}, m={m}): programs deadlocked at step {t}")
        for r, a in runs:
            done.add((a.kind, a.mb, r))
            pos[r] += 1
            placements.append((t, r, a))
        t += 1
    return _build("zb_h1", p, m, 1, True, placements)


def _check_name_v(name: str, v: int) -> None:
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULE_NAMES)}")
    if name != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v} needs schedule 'interleaved_1f1b', not {name!r} (v=1)")


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` for p ranks, m microbatches and v virtual stages per rank."""
    _check_name_v(name, v)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, v)
    return zb_h1(p, m)


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


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Textbook bubble fraction (idle time over total time).

    gpipe, 1f1b: (p - 1) / (m + p - 1). interleaved_1f1b: (p - 1) / (v*m + p - 1).
    zb_h1: Qi et al. give a bubble of (p - 1)(T_F + T_B - T_W); with T_F = T_B = T_W = 1 (this
    module's split costs) that is p - 1 units against 3m of work per rank, so
    (p - 1) / (3m + p - 1). It assumes m >= p.
    """
    _check_sizes(p, m, v)
    _check_name_v(name, v)
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def _cell_label(cell: Cell, show_vstage: bool) -> str:
    return "".join(a.label(show_vstage) for a in cell) or "."


def render(schedule: Schedule) -> str:
    """The grid as text: one row per rank, one column per step, then each step's cost."""
    show_v = schedule.virtual_stages > 1
    labels = [[_cell_label(cell, show_v) for cell in row] for row in schedule.grid]
    costs = step_costs(schedule)
    columns = [[str(t), *labels[t], str(costs[t])] for t in range(schedule.num_steps)]
    widths = [max(len(x) for x in col) for col in columns]
    names = ["step", *(f"r{r}" for r in range(schedule.num_ranks)), "cost"]
    head = max(len(x) for x in names)
    split = ", B split into B (input grad) + W (weight grad)" if schedule.split_backward else ""
    lines = [
        f"{schedule.name}: p={schedule.num_ranks} m={schedule.num_microbatches} "
        f"v={schedule.virtual_stages}, {schedule.num_steps} steps{split}"
    ]
    for k, name in enumerate(names):
        lines.append(" ".join([name.ljust(head)] + [col[k].rjust(w) for col, w in zip(columns, widths)]))
    return "\n".join(lines)


_HEADER = re.compile(r"^(\S+): p=(\d+) m=(\d+) v=(\d+), (\d+) steps(, B split.*)?$")
_ACTION = re.compile(r"([FBW])(\d+)(?:\.(\d+))?")


def parse(text: str) -> Schedule:
    """The inverse of `render`: a Schedule from its printed grid (the `cost` row is ignored).

    Cells are `.` (idle) or concatenated actions such as `F3`, `F3B1`, or `F3.1B0.0` (microbatch
    `.` virtual stage) when v > 1.
    """
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    head = _HEADER.match(lines[0].strip())
    if not head:
        raise ValueError(f"not a schedule header: {lines[0]!r}")
    name, p, m, v, steps, split = head.groups()
    p, m, v, steps = int(p), int(m), int(v), int(steps)
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
    return Schedule(name, p, m, v, bool(split), grid)
