"""Turns a schedule table into what the SPMD engine indexes each step: branches and buffer slots.

Pure numpy, computed once per (schedule, p, m, v). The engine (`engine.py`) keeps two buffers per
rank in its scan carry:

  acts[K_a + 1]   stage inputs. The activation a rank receives for step t is written to slot
                  `recv_act[t]`; it stays until the stage's last backward-type action (B, or W
                  when the backward is split) has recomputed from it. This one buffer is both the
                  "received but not yet consumed" mailbox (zb_h1 / interleaved wait several steps)
                  and the 1F1B stash. Within a step the engine runs B/W, then writes the arrival,
                  then F, so a slot released by this step's B/W takes this step's arrival.
  grads[K_g + 1]  output gradients, written at the start of the step (B may use one at once) and
                  kept until B (or W, which needs it again). They come from the next stage
                  (`recv_grad`) or, for the last stage, from the LM head, which every rank runs
                  right after the last stage's F (`recv_head`: the head's gradient of the last
                  stage's output, computed at step t, is stored at t + 1).

Slots are assigned per rank by interval colouring over [arrival step, release step]; slot K (the
extra last one) is a write-only trash slot for steps where nothing arrives, so the engine never
branches on writes. Stage 0 reads its input from the embedding, not `acts`.

Branches. `fwd_branch`: 0 idle, 1 run the stage's layers (every stage, the last one too: its
output feeds the head). `back_branch` indexes `SlotPlan.back_branches`: entry 0 is idle, every
other entry a `BackBranch` naming what one B or W differentiates — deduplicated, so stages share
a branch (they differ only in where their input comes from and their input gradient goes, which
the engine decides outside the branches).

Per-step fields (the same for every rank, `STEP_FIELDS`): which microbatch stage 0 embeds for
its F and for its B/W (every rank takes part in the vocab-parallel lookup), and whether and for
which microbatch the last stage runs F (every rank then runs its share of the LM head + loss).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.parallel.pipeline.checks import validate
from jaxpar.parallel.pipeline.schedules import make_schedule
from jaxpar.parallel.pipeline.table import B, F, W, Schedule

IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
# Per-(step, rank) int32 fields the engine scans over.
FIELDS = (
    "recv_act", "recv_grad",
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
    tables: dict  # field -> int32 [T, p]
    steps: dict  # STEP_FIELDS -> int32 [T]

    @property
    def split_backward(self) -> bool:
        return self.schedule.split_backward


def _kind(stage: int, num_stages: int) -> int:
    return FIRST if stage == 0 else LAST if stage == num_stages - 1 else MIDDLE


def back_branch(kind: int, is_w: bool, split_backward: bool) -> BackBranch | None:
    """The branch a B (`is_w` False) or W on a stage of `kind` runs; None when it has nothing to do."""
    params = is_w or not split_backward
    inputs = (not is_w and kind != FIRST) or (kind == FIRST and params)
    return BackBranch(params, inputs) if params or inputs else None


def _colour(intervals: dict, reuse_at_release: bool) -> tuple[dict, int]:
    """Slots for {key: (start, end)} step intervals on one rank. With `reuse_at_release` a
    slot read for the last time at step e may be written again at step e (the engine reads first)."""
    free_at: list[int] = []  # per slot: first step it may be written again
    slots = {}
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        slot = next((k for k, t in enumerate(free_at) if t <= start), len(free_at))
        if slot == len(free_at):
            free_at.append(0)
        free_at[slot] = end if reuse_at_release else end + 1
        slots[key] = slot
    return slots, len(free_at)


def build_slot_plan(schedule: Schedule) -> SlotPlan:
    validate(schedule)
    p, S = schedule.num_ranks, schedule.num_stages
    split = schedule.split_backward
    release_kind = W if split else B
    when = {}  # (kind, mb, global stage) -> step
    for t, row in enumerate(schedule.grid):
        for r, cell in enumerate(row):
            for a in cell:
                when[(a.kind, a.mb, schedule.global_stage(r, a.vstage))] = t

    # Liveness per rank: a value sent at step t arrives at the start of t + 1.
    act_live = [dict() for _ in range(p)]
    grad_live = [dict() for _ in range(p)]
    for (kind, mb, s), t in when.items():
        if kind == F and s < S - 1:
            act_live[(s + 1) % p][(mb, s + 1)] = (t + 1, when[(release_kind, mb, s + 1)])
        if kind == B and s > 0:
            grad_live[(s - 1) % p][(mb, s - 1)] = (t + 1, when[(release_kind, mb, s - 1)])
        if kind == F and s == S - 1:  # the head's gradient of the last stage's output
            grad_live[s % p][(mb, s)] = (t + 1, when[(release_kind, mb, s)])
    act_slot, grad_slot = [], []
    k_act = k_grad = 0
    for r in range(p):
        slots, k = _colour(act_live[r], reuse_at_release=True)
        act_slot.append(slots)
        k_act = max(k_act, k)
        slots, k = _colour(grad_live[r], reuse_at_release=False)
        grad_slot.append(slots)
        k_grad = max(k_grad, k)

    T = schedule.num_steps
    tab = {f: np.zeros((T, p), np.int32) for f in FIELDS}
    tab["recv_act"][:], tab["fwd_slot"][:], tab["back_slot"][:] = k_act, k_act, k_act  # trash slots
    tab["recv_grad"][:], tab["back_grad_slot"][:], tab["recv_head"][:] = k_grad, k_grad, k_grad
    for r in range(p):
        for (mb, s), (start, _) in act_live[r].items():
            tab["recv_act"][start, r] = act_slot[r][(mb, s)]
        for (mb, s), (start, _) in grad_live[r].items():
            tab["recv_head" if s == S - 1 else "recv_grad"][start, r] = grad_slot[r][(mb, s)]
    steps = {f: np.zeros(T, np.int32) for f in STEP_FIELDS}
    branches = [None]
    for (kind, mb, s), t in when.items():
        r, pre, stage_kind = s % p, "fwd" if kind == F else "back", _kind(s, S)
        tab[f"{pre}_kind"][t, r] = stage_kind
        tab[f"{pre}_mb"][t, r] = mb
        tab[f"{pre}_stage"][t, r] = s // p
        tab[f"{pre}_slot"][t, r] = act_slot[r].get((mb, s), k_act)
        if kind == F:
            tab["fwd_branch"][t, r] = 1
            if s == 0:
                steps["embed_fwd_mb"][t] = mb
            if s == S - 1:
                steps["has_head"][t], steps["head_mb"][t] = 1, mb
        else:
            tab["back_grad_slot"][t, r] = grad_slot[r].get((mb, s), k_grad)
            branch = back_branch(stage_kind, kind == W, split)
            if s == 0 and branch is not None:
                steps["embed_back_mb"][t] = mb
            if branch not in branches:
                branches.append(branch)
            tab["back_branch"][t, r] = branches.index(branch)
    return SlotPlan(schedule, k_act, k_grad, tuple(branches), tab, steps)


@functools.lru_cache(maxsize=64)
def slot_plan_for(name: str, p: int, m: int, v: int) -> SlotPlan:
    return build_slot_plan(make_schedule(name, p, m, v))
