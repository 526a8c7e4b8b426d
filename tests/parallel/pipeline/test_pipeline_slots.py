"""The engine's slot plan, checked by replaying its buffer operations on labels (no jax).

The replay does exactly what `jaxpar.parallel.pipeline.engine` does each step — store the
received gradients (one per hop, and the LM head's for the last stage), run B/W, store the
received activations (one per hop), run F (the last stage's output goes to the head, whose
gradient is stored next step), send every rank's output over every hop of the stage map — but
with (destination rank, (microbatch, stage)) labels instead of arrays, and asserts that every
real arrival, and only those, gets a slot and that every read finds the right label.
Which action a cell holds comes from the schedule table; everything the engine reads (slots,
stage kinds, branches) comes from the slot plan. Modular tables (every schedule) and V-shaped
ones (`tests/support/v_shape.py`: hops +1, 0 and -1, both ends on rank 0).
"""

import pytest

from jaxpar.parallel.pipeline.checks import peak_in_flight
from jaxpar.parallel.pipeline.schedules import make_schedule
from jaxpar.parallel.pipeline.slots import FIRST, LAST, MIDDLE, back_branch, build_slot_plan
from jaxpar.parallel.pipeline.table import B, W, parse
from tests.support.v_shape import v_table

CASES = [
    ("gpipe", 2, 3, 1), ("gpipe", 4, 8, 1),
    ("1f1b", 2, 1, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 13, 1),
    ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 3, 6, 3),
    ("zb_h1", 2, 2, 1), ("zb_h1", 4, 8, 1), ("zb_h1", 4, 3, 1),
    ("zb_v", 2, 2, 2), ("zb_v", 4, 8, 2), ("zb_v", 3, 5, 2), ("dualpipev", 2, 4, 2), ("dualpipev", 4, 9, 2),
]
V_CASES = [  # (p, m, split backward, order)
    (2, 4, False, "1f1b"), (2, 3, True, "gpipe"), (3, 3, True, "1f1b"), (4, 8, False, "1f1b"), (4, 4, True, "gpipe"),
]


def stage_kind(s, num_stages):
    return FIRST if s == 0 else LAST if s == num_stages - 1 else MIDDLE


def deliver(sent, hop, forward, p):
    """What each rank receives over `hop` when every rank sends `sent[rank]` (None: zeros)."""
    if hop.distance == 0:
        return list(sent)
    out = [None] * p
    for a, b in hop.pairs if forward else [(b, a) for a, b in hop.pairs]:
        out[b] = sent[a]
    return out


def store(buffer, arrival, slot, trash, r, where):
    """An arrival is real when it was sent to this rank: then, and only then, it has a slot."""
    real = arrival is not None and arrival[0] == r
    assert real == (slot != trash), (where, r, arrival, slot)
    buffer[slot] = arrival[1] if real else "garbage"


def replay(plan):
    sched = plan.schedule
    p, S, split = sched.num_ranks, sched.num_stages, sched.split_backward
    rank = [r for r, _ in sched.stages]
    tab, hops = plan.tables, sched.hops
    acts = [[None] * (plan.act_slots + 1) for _ in range(p)]
    grads = [[None] * (plan.grad_slots + 1) for _ in range(p)]
    in_act, in_grad, in_head = [[None] * p for _ in hops], [[None] * p for _ in hops], [None] * p
    done = set()
    for t in range(sched.num_steps):
        send_act, send_grad, head = [None] * p, [None] * p, [None] * p
        for r in range(p):
            for h, (_, field) in enumerate(plan.recv_fields):
                store(grads[r], in_grad[h][r], tab[field][t, r], plan.grad_slots, r, (t, field))
            store(grads[r], in_head[r], tab["recv_head"][t, r], plan.grad_slots, r, (t, "recv_head"))
            back = [a for a in sched.grid[t][r] if a.kind in (B, W)]
            branch = plan.back_branches[tab["back_branch"][t, r]]
            if back:
                is_w = back[0].kind == W
                mb, u = tab["back_mb"][t, r], tab["back_stage"][t, r]
                s = sched.global_stage(r, u)
                assert (mb, u) == (back[0].mb, back[0].vstage)
                assert tab["back_kind"][t, r] == stage_kind(s, S)
                assert branch == back_branch(stage_kind(s, S), is_w, split)
                if s > 0:
                    assert acts[r][tab["back_slot"][t, r]] == (mb, s)
                else:
                    assert (plan.steps["embed_back_mb"][t] == mb) or branch is None
                assert grads[r][tab["back_grad_slot"][t, r]] == (mb, s)
                if not is_w and s > 0:
                    send_grad[r] = (rank[s - 1], (mb, s - 1))
                done.add(("W" if is_w else "B", mb, s))
            else:
                assert branch is None
            for h, (field, _) in enumerate(plan.recv_fields):
                store(acts[r], in_act[h][r], tab[field][t, r], plan.act_slots, r, (t, field))
            if any(a.kind == "F" for a in sched.grid[t][r]):
                mb, s = tab["fwd_mb"][t, r], sched.global_stage(r, tab["fwd_stage"][t, r])
                assert tab["fwd_kind"][t, r] == stage_kind(s, S)
                assert tab["fwd_branch"][t, r] == 1
                if s > 0:
                    assert acts[r][tab["fwd_slot"][t, r]] == (mb, s)
                else:
                    assert plan.steps["embed_fwd_mb"][t] == mb
                if s < S - 1:
                    send_act[r] = (rank[s + 1], (mb, s + 1))
                else:  # every rank runs the head on it now; its gradient is stored next step
                    assert plan.steps["has_head"][t] == 1 and plan.steps["head_mb"][t] == mb
                    head[r] = (r, (mb, s))
                done.add(("F", mb, s))
            else:
                assert tab["fwd_branch"][t, r] == 0
        if not any(head):
            assert plan.steps["has_head"][t] == 0
        in_act = [deliver(send_act, hop, True, p) for hop in hops]
        in_grad = [deliver(send_grad, hop, False, p) for hop in hops]
        in_head = head
    m = sched.num_microbatches
    kinds = ("F", "B", "W") if split else ("F", "B")
    assert done == {(k, mb, s) for k in kinds for mb in range(m) for s in range(S)}


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_replay_reads_the_right_values(name, p, m, v):
    replay(build_slot_plan(make_schedule(name, p, m, v)))


@pytest.mark.parametrize("p, m, split, order", V_CASES)
def test_replay_v_shaped_tables(p, m, split, order):
    """Arrivals follow the actual sender and receiver of each hop: several per step on one rank
    (from both neighbours, and its own previous output on rank p - 1), real ones only where sent."""
    plan = build_slot_plan(v_table(p, m, split_backward=split, order=order))
    assert [h.distance for h in plan.hops] == sorted({0, 1, p - 1})
    replay(plan)
    # Both ends on rank 0: stage 0 embeds there, the head's gradient is stored there.
    assert set(plan.tables["fwd_kind"][:, 0]) >= {FIRST, LAST}
    assert (plan.tables["recv_head"][:, 1:] == plan.grad_slots).all()
    assert (plan.tables["recv_head"][:, 0] < plan.grad_slots).sum() == m


def test_replay_catches_a_misrouted_arrival():
    """Positive control: the replay notices an arrival read from the wrong hop."""
    plan = build_slot_plan(v_table(4, 4))
    fields = dict(plan.recv_fields)
    a, b = list(fields)[1:3]  # hops +1 and -1
    plan.tables[a], plan.tables[b] = plan.tables[b].copy(), plan.tables[a].copy()
    with pytest.raises(AssertionError):
        replay(plan)


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
