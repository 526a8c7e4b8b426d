"""Turns a schedule table into what the SPMD engine indexes each step: branches and buffer slots.

Pure numpy, computed once per table. The engine (`engine.py`) keeps two buffers per rank in its
scan carry:

  acts[K_a + 1]   stage inputs. An activation arriving at the start of step t is written to slot
                  `recv_act{h}[t]`, h the hop that carried it (see below); it stays until the
                  stage's last backward-type action (B, or W when the backward is split) has
                  recomputed from it. This one buffer is both the "received but not yet consumed"
                  mailbox (zb_h1 / interleaved wait several steps) and the 1F1B stash. Within a
                  step the engine runs B/W, then writes the arrivals, then F, so a slot released by
                  this step's B/W takes this step's arrival.
  grads[K_g + 1]  output gradients, written at the start of the step (B may use one at once) and
                  kept until B (or W, which needs it again). They come from the next stage
                  (`recv_grad{h}`) or, for the last stage, from the LM head, which every rank runs
                  right after the last stage's F (`recv_head`: the head's gradient of the last
                  stage's output, computed at step t, is stored at t + 1).

Hops. Stage s sends its output to stage s + 1 on rank(s + 1), over rank distance d =
(rank(s + 1) - rank(s)) mod p (`Schedule.hops`: one hop per distance the stage map uses, d = 0
staying on the rank); the gradient goes back over the same hop. The engine moves every step's
output over every hop (one `ppermute` per hop and direction, none for d = 0), so each rank
receives one value per hop per step; the `recv_*{h}` fields say which of those are real and
where they go. Liveness and slots follow the actual receiving rank of each value.

Slots are assigned per rank by interval colouring over [arrival step, release step]; slot K (the
extra last one) is a write-only trash slot for steps where nothing real arrives, so the engine
never branches on writes. Stage 0 reads its input from the embedding, not `acts`.

Branches. `fwd_branch`: 0 idle, 1 run the stage's layers (every stage, the last one too: its
output feeds the head). `back_branch` indexes `SlotPlan.back_branches`: entry 0 is idle, every
other entry a `BackBranch` naming what one B or W differentiates — deduplicated, so stages share
a branch (they differ only in where their input comes from and their input gradient goes, which
the engine decides outside the branches). `fwd_stage` / `back_stage` are local virtual stages.

Per-step fields (the same for every rank, `STEP_FIELDS`): which microbatch stage 0 embeds for
its F and for its B/W (every rank takes part in the vocab-parallel lookup), and whether and for
which microbatch the last stage runs F (every rank then runs its share of the LM head + loss).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

from jaxpar.parallel.pipeline.checks import validate
from jaxpar.parallel.pipeline.schedules import make_schedule
from jaxpar.parallel.pipeline.table import B, F, Schedule, W

IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
# Per-(step, rank) int32 fields the engine scans over, besides one `recv_act{h}` and one
# `recv_grad{h}` per hop h (`SlotPlan.recv_fields`).
FIELDS = (
    "fwd_branch", "fwd_kind", "fwd_mb", "fwd_stage", "fwd_slot",
    "back_branch", "back_kind", "back_mb", "back_stage", "back_slot", "back_grad_slot", "recv_head",
)
# Per-step int32 fields [T], identical on every rank.
STEP_FIELDS = ("embed_fwd_mb", "embed_back_mb", "has_head", "head_mb")


@dataclasses.dataclass(frozen=True)
class BackBranch:
    """What one backward-type action differentiates: the stage's parameters (full B, or W), its
    input (full B, split B; W on the first stage, whose input gradient feeds the embedding's
    weight gradient)."""

    params: bool
    inputs: bool


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    schedule: Schedule
    act_slots: int  # K_a: live stage inputs per rank, at most (buffer has K_a + 1 slots)
    grad_slots: int  # K_g
    back_branches: tuple  # (None, BackBranch, ...): index 0 idle
    tables: dict  # FIELDS and `recv_fields` -> int32 [T, p]
    steps: dict  # STEP_FIELDS -> int32 [T]

    @property
    def split_backward(self) -> bool:
        return self.schedule.split_backward

    @property
    def hops(self) -> tuple:
        return self.schedule.hops

    @property
    def recv_fields(self) -> tuple:
        """(activation field, gradient field) per hop, in `hops` order."""
        return tuple((f"recv_act{h}", f"recv_grad{h}") for h in range(len(self.hops)))


def _kind(stage: int, num_stages: int) -> int:
    return FIRST if stage == 0 else LAST if stage == num_stages - 1 else MIDDLE


def back_branch(kind: int, is_w: bool, split_backward: bool) -> BackBranch | None:
    """The branch a B (`is_w` False) or W on a stage of `kind` runs; None when it has nothing to do."""
    params = is_w or not split_backward
    inputs = (not is_w and kind != FIRST) or (kind == FIRST and params)
    return BackBranch(params, inputs) if params or inputs else None


def _colour(intervals: dict, reuse_at_release: bool) -> tuple[dict, int]:
    """Slots for {key: (start, end)} step intervals on one rank, each the lowest-numbered slot free at
    its start. With `reuse_at_release` a slot read for the last time at step e may be written again
    at step e (the engine reads first)."""
    # Starts come in order, so a slot free at one start stays free until it is taken: heaps of the
    # busy slots (by the step they free) and the free ones (by number) replace a scan of every slot.
    busy: list[tuple[int, int]] = []  # (first step it may be written again, slot)
    free: list[int] = []
    slots, count = {}, 0
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, count = count, count + 1
        heapq.heappush(busy, (end if reuse_at_release else end + 1, slot))
        slots[key] = slot
    return slots, count


def build_slot_plan(schedule: Schedule) -> SlotPlan:
    validate(schedule)
    p, S = schedule.num_ranks, schedule.num_stages
    split = schedule.split_backward
    release_kind = W if split else B
    rank = [r for r, _ in schedule.stages]
    stage_of = {place: s for s, place in enumerate(schedule.stages)}
    hop = {hop.distance: h for h, hop in enumerate(schedule.hops)}
    via = [hop[(rank[s + 1] - rank[s]) % p] for s in range(S - 1)]  # the hop from stage s to s + 1
    act_field, grad_field = [f"recv_act{h}" for h in via], [f"recv_grad{h}" for h in via]  # per stage s, not per value
    when = {}  # (kind, mb, global stage) -> step
    for t, row in enumerate(schedule.grid):
        for r, cell in enumerate(row):
            for a in cell:
                when[(a.kind, a.mb, stage_of[(r, a.vstage)])] = t

    # Liveness on the receiving rank: a value sent at step t arrives at the start of t + 1.
    # (mb, stage) -> (arrival, release, field the arrival is read from)
    act_live = [dict() for _ in range(p)]
    grad_live = [dict() for _ in range(p)]
    for (kind, mb, s), t in when.items():
        if kind == F and s < S - 1:
            act_live[rank[s + 1]][(mb, s + 1)] = (t + 1, when[(release_kind, mb, s + 1)], act_field[s])
        if kind == B and s > 0:
            grad_live[rank[s - 1]][(mb, s - 1)] = (t + 1, when[(release_kind, mb, s - 1)], grad_field[s - 1])
        if kind == F and s == S - 1:  # the head's gradient of the last stage's output
            grad_live[rank[s]][(mb, s)] = (t + 1, when[(release_kind, mb, s)], "recv_head")
    act_slot, grad_slot = [], []
    k_act = k_grad = 0
    for r in range(p):
        slots, k = _colour({key: x[:2] for key, x in act_live[r].items()}, reuse_at_release=True)
        act_slot.append(slots)
        k_act = max(k_act, k)
        slots, k = _colour({key: x[:2] for key, x in grad_live[r].items()}, reuse_at_release=False)
        grad_slot.append(slots)
        k_grad = max(k_grad, k)

    # Filled as nested lists and turned into int32 arrays at the end: setting numpy elements one
    # by one was most of this function's time.
    T = schedule.num_steps
    recv = [f"recv_{x}{h}" for h in range(len(hop)) for x in ("act", "grad")]
    tab = {}
    for f in FIELDS + tuple(recv):  # trash slots
        trash = k_act if f.startswith("recv_act") or f in ("fwd_slot", "back_slot") else (
            k_grad if f.startswith("recv_") or f == "back_grad_slot" else 0)
        tab[f] = [[trash] * p for _ in range(T)]
    for r in range(p):
        for (mb, s), (start, _, field) in act_live[r].items():
            tab[field][start][r] = act_slot[r][(mb, s)]
        for (mb, s), (start, _, field) in grad_live[r].items():
            tab[field][start][r] = grad_slot[r][(mb, s)]
    steps = {f: [0] * T for f in STEP_FIELDS}
    branches = [None]
    branch_index = {None: 0}
    fwd = [tab["fwd_kind"], tab["fwd_mb"], tab["fwd_stage"], tab["fwd_slot"]]
    back = [tab["back_kind"], tab["back_mb"], tab["back_stage"], tab["back_slot"]]
    fwd_branch, back_grad_slot, back_branch_tab = tab["fwd_branch"], tab["back_grad_slot"], tab["back_branch"]
    stage_kinds = [_kind(s, S) for s in range(S)]
    for (kind, mb, s), t in when.items():
        (r, u), stage_kind = schedule.stages[s], stage_kinds[s]
        kinds, mbs, stages, slots = fwd if kind == F else back
        kinds[t][r] = stage_kind
        mbs[t][r] = mb
        stages[t][r] = u
        slots[t][r] = act_slot[r].get((mb, s), k_act)
        if kind == F:
            fwd_branch[t][r] = 1
            if s == 0:
                steps["embed_fwd_mb"][t] = mb
            if s == S - 1:
                steps["has_head"][t], steps["head_mb"][t] = 1, mb
        else:
            back_grad_slot[t][r] = grad_slot[r].get((mb, s), k_grad)
            branch = back_branch(stage_kind, kind == W, split)
            if s == 0 and branch is not None:
                steps["embed_back_mb"][t] = mb
            if branch not in branch_index:  # a dict, not `list.index`: one dataclass __eq__ per branch seen
                branch_index[branch] = len(branches)
                branches.append(branch)
            back_branch_tab[t][r] = branch_index[branch]
    tables = {f: np.array(x, np.int32).reshape(T, p) for f, x in tab.items()}
    steps = {f: np.array(x, np.int32).reshape(T) for f, x in steps.items()}
    return SlotPlan(schedule, k_act, k_grad, tuple(branches), tables, steps)


@functools.lru_cache(maxsize=64)
def slot_plan_for(name, p: int, m: int, v: int) -> SlotPlan:
    """The slot plan of `make_schedule(name, p, m, v)` (a name or a `ScheduleKind`), cached."""
    return build_slot_plan(make_schedule(name, p, m, v))
