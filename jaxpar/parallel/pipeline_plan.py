"""Turns a schedule table into what the SPMD engine indexes each step: branch codes and buffer slots.

Pure numpy, computed once per (schedule, p, m, v). The engine (`jaxpar.parallel.pipeline`) keeps two
ring-free buffers per rank in its scan carry:

  acts[K_a + 1]   stage inputs. The activation a rank receives for step t is written to slot
                  `recv_act[t]`; it stays until the stage's last backward-type action (B, or W
                  when the backward is split) has recomputed from it. This one buffer is both the
                  "received but not yet consumed" mailbox (zb_h1 / interleaved wait several steps)
                  and the 1F1B stash. Within a step the engine runs B/W, then writes the arrival,
                  then F, so a slot released by this step's B/W takes this step's arrival: the
                  1F1B stash is min(m, 2(p - r) - 1) on rank r, as `peak_in_flight` counts it.
  grads[K_g + 1]  output gradients, received from the next stage; written at the start of the
                  step (B may use one at once) and kept until B (or W, which needs it again).

Slots are assigned per rank by interval colouring over [arrival step, release step]; slot K (the
extra last one) is a write-only trash slot for steps where nothing arrives, so the engine never
branches on writes. Stage 0 reads tokens, not `acts`; the last stage's output gradient is the
loss's own, so neither needs a slot.

Branch codes. Forward (`f_kind`): 0 idle, 1 first global stage, 2 middle, 3 last. Backward-type
(`k_kind`; a cell holds at most one of B and W): 0 idle, 1-3 B on a first/middle/last stage, 4-6
W on a first/middle/last stage.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.parallel.schedule_check import validate
from jaxpar.parallel.schedules import B, F, W, Schedule, make_schedule

IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
W_OFFSET = 3  # k_kind of a W = W_OFFSET + its stage kind
# Per-(step, rank) int32 fields the engine scans over.
FIELDS = (
    "recv_act", "recv_grad",
    "f_kind", "f_mb", "f_stage", "f_slot",
    "k_kind", "k_mb", "k_stage", "k_slot", "k_gslot",
)


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: Schedule
    act_slots: int  # K_a: live stage inputs per rank, at most (buffer has K_a + 1 slots)
    grad_slots: int  # K_g
    tables: dict  # field -> int32 [T, p]

    @property
    def split_backward(self) -> bool:
        return self.schedule.split_backward


def _kind(stage: int, num_stages: int) -> int:
    return FIRST if stage == 0 else LAST if stage == num_stages - 1 else MIDDLE


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


def build_plan(schedule: Schedule) -> Plan:
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
    tab = {f: np.full((T, p), -1, np.int32) for f in FIELDS}
    tab["recv_act"][:] = k_act  # trash slot
    tab["recv_grad"][:] = k_grad
    tab["f_kind"][:] = IDLE
    tab["k_kind"][:] = IDLE
    for r in range(p):
        for (mb, s), (start, _) in act_live[r].items():
            tab["recv_act"][start, r] = act_slot[r][(mb, s)]
        for (mb, s), (start, _) in grad_live[r].items():
            tab["recv_grad"][start, r] = grad_slot[r][(mb, s)]
    for (kind, mb, s), t in when.items():
        r, pre = s % p, "f" if kind == F else "k"
        tab[f"{pre}_kind"][t, r] = _kind(s, S) + (W_OFFSET if kind == W else 0)
        tab[f"{pre}_mb"][t, r] = mb
        tab[f"{pre}_stage"][t, r] = s // p
        tab[f"{pre}_slot"][t, r] = act_slot[r].get((mb, s), k_act)
        if kind != F:
            tab[f"{pre}_gslot"][t, r] = grad_slot[r].get((mb, s), k_grad)
    # Unused indices point at the trash slot / stage 0 / microbatch 0, so every gather is in range.
    for f in FIELDS:
        if f.endswith(("_mb", "_stage")):
            tab[f] = np.maximum(tab[f], 0)
        elif f.endswith("_slot"):
            tab[f] = np.where(tab[f] < 0, k_act, tab[f])
        elif f.endswith("_gslot"):
            tab[f] = np.where(tab[f] < 0, k_grad, tab[f])
    return Plan(schedule, k_act, k_grad, tab)


@functools.lru_cache(maxsize=64)
def plan_for(name: str, p: int, m: int, v: int) -> Plan:
    return build_plan(make_schedule(name, p, m, v))


def stash_depth(plan: Plan) -> list[int]:
    """Per rank, the most stage inputs held in `acts` at once (arrived, not yet released)."""
    s = plan.schedule
    release = W if s.split_backward else B
    out = []
    for r in range(s.num_ranks):
        live = peak = 0
        for t, row in enumerate(s.grid):
            live -= sum(1 for a in row[r] if a.kind == release and s.global_stage(r, a.vstage) > 0)
            live += int(plan.tables["recv_act"][t, r] < plan.act_slots)
            peak = max(peak, live)
        out.append(peak)
    return out
