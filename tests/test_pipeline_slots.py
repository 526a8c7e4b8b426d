"""The engine's slot plan, checked by replaying its buffer operations on labels (no jax).

The replay does exactly what `jaxpar.parallel.pipeline.engine` does each step — store the
received gradients (from the next rank, and the LM head's for the last stage), run B/W, store the
received activation, run F (the last stage's output goes to the head, whose gradient is stored
next step), pass values one rank on — but with (microbatch, stage) labels instead of arrays, and
asserts every read finds the right label.
Which action a cell holds comes from the schedule table; everything the engine reads (slots,
stage kinds, branches) comes from the slot plan.
"""

import pytest

from jaxpar.parallel.pipeline.checks import peak_in_flight
from jaxpar.parallel.pipeline.schedules import make_schedule
from jaxpar.parallel.pipeline.table import B, W, parse
from jaxpar.parallel.pipeline.slots import FIRST, LAST, MIDDLE, back_branch, build_slot_plan

CASES = [
    ("gpipe", 2, 3, 1), ("gpipe", 4, 8, 1),
    ("1f1b", 2, 1, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 13, 1),
    ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 3, 6, 3),
    ("zb_h1", 2, 2, 1), ("zb_h1", 4, 8, 1), ("zb_h1", 4, 3, 1),
]


def stage_kind(s, num_stages):
    return FIRST if s == 0 else LAST if s == num_stages - 1 else MIDDLE


def replay(plan):
    sched = plan.schedule
    p, S, split = sched.num_ranks, sched.num_stages, sched.split_backward
    tab = plan.tables
    acts = [[None] * (plan.act_slots + 1) for _ in range(p)]
    grads = [[None] * (plan.grad_slots + 1) for _ in range(p)]
    in_act, in_grad, in_head = [None] * p, [None] * p, [None] * p
    done = set()
    for t in range(sched.num_steps):
        send_act, send_grad, head = [None] * p, [None] * p, [None] * p
        for r in range(p):
            slot = tab["recv_grad"][t, r]
            assert (in_grad[r] is None) == (slot == plan.grad_slots), (t, r, in_grad[r])
            grads[r][slot] = in_grad[r]
            slot = tab["recv_head"][t, r]
            assert (in_head[r] is None) == (slot == plan.grad_slots), (t, r, in_head[r])
            grads[r][slot] = in_head[r]
            back = [a for a in sched.grid[t][r] if a.kind in (B, W)]
            branch = plan.back_branches[tab["back_branch"][t, r]]
            if back:
                is_w = back[0].kind == W
                mb, s = tab["back_mb"][t, r], tab["back_stage"][t, r] * p + r
                assert (mb, s % p, s // p) == (back[0].mb, r, back[0].vstage)
                assert tab["back_kind"][t, r] == stage_kind(s, S)
                assert branch == back_branch(stage_kind(s, S), is_w, split)
                if s > 0:
                    assert acts[r][tab["back_slot"][t, r]] == (mb, s)
                else:
                    assert (plan.steps["embed_back_mb"][t] == mb) or branch is None
                assert grads[r][tab["back_grad_slot"][t, r]] == (mb, s)
                if not is_w and s > 0:
                    send_grad[r] = (mb, s - 1)
                done.add(("W" if is_w else "B", mb, s))
            else:
                assert branch is None
            slot = tab["recv_act"][t, r]
            assert (in_act[r] is None) == (slot == plan.act_slots), (t, r, in_act[r])
            acts[r][slot] = in_act[r]
            if any(a.kind == "F" for a in sched.grid[t][r]):
                mb, s = tab["fwd_mb"][t, r], tab["fwd_stage"][t, r] * p + r
                assert tab["fwd_kind"][t, r] == stage_kind(s, S)
                assert tab["fwd_branch"][t, r] == 1
                if s > 0:
                    assert acts[r][tab["fwd_slot"][t, r]] == (mb, s)
                else:
                    assert plan.steps["embed_fwd_mb"][t] == mb
                if s < S - 1:
                    send_act[r] = (mb, s + 1)
                else:  # every rank runs the head on it now; its gradient is stored next step
                    assert plan.steps["has_head"][t] == 1 and plan.steps["head_mb"][t] == mb
                    head[r] = (mb, s)
                done.add(("F", mb, s))
            else:
                assert tab["fwd_branch"][t, r] == 0
        if not any(head):
            assert plan.steps["has_head"][t] == 0
        in_act = [send_act[(r - 1) % p] for r in range(p)]
        in_grad = [send_grad[(r + 1) % p] for r in range(p)]
        in_head = head
    m = sched.num_microbatches
    kinds = ("F", "B", "W") if split else ("F", "B")
    assert done == {(k, mb, s) for k in kinds for mb in range(m) for s in range(S)}


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_replay_reads_the_right_values(name, p, m, v):
    replay(build_slot_plan(make_schedule(name, p, m, v)))


@pytest.mark.parametrize("m", [1, 4, 8, 32])
def test_buffer_bounds(m):
    p = 4
    one_f_one_b = build_slot_plan(make_schedule("1f1b", p, m))
    gpipe = build_slot_plan(make_schedule("gpipe", p, m))
    # Rank 0 runs stage 0, whose input is tokens; rank 1 stashes the most: min(m, 2p - 3).
    assert peak_in_flight(one_f_one_b.schedule) == [min(m, 2 * (p - r) - 1) for r in range(p)]
    assert one_f_one_b.act_slots == min(m, 2 * p - 3) and gpipe.act_slots == m
    zb = build_slot_plan(make_schedule("zb_h1", p, m))
    assert max(peak_in_flight(zb.schedule)) <= p


def test_literal_table_replays_and_dedupes_branches():
    """A hand-written table, stated as its printed grid: the slot plan reads the right values and
    the backward branches are the three a split backward needs (plus idle)."""
    table = parse("""
        zb_h1: p=2 m=2 v=1, 7 steps, B split into B (input grad) + W (weight grad)
        step  0  1  2  3  4  5  6
        r0   F0 F1  . B0 W0 B1 W1
        r1    . F0 B0 F1 B1 W0 W1
        cost  1  1  1  1  1  1  1
    """)
    assert table == make_schedule("zb_h1", 2, 2)
    plan = build_slot_plan(table)
    replay(plan)
    # Last-stage B: input only; last-stage W: params; first-stage W: params + input (for the
    # embedding's weight gradient); first-stage split B: nothing to do, so idle.
    assert set(plan.back_branches) == {
        None, back_branch(LAST, False, True), back_branch(LAST, True, True), back_branch(FIRST, True, True)
    }
    assert back_branch(FIRST, False, True) is None and back_branch(MIDDLE, False, True).params is False
