"""The engine's static plan, checked by replaying its buffer operations on labels (no jax).

The replay does exactly what `jaxpar.parallel.pipeline._engine` does each step — store the
received gradient, run B/W, store the received activation, run F, pass values one rank on — but
with (microbatch, stage) labels instead of arrays, and asserts every read finds the right label.
"""

import pytest

from jaxpar.parallel.pipeline_plan import FIRST, IDLE, LAST, MIDDLE, W_OFFSET, build_plan, stash_depth
from jaxpar.parallel.schedules import make_schedule

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
    in_act, in_grad = [None] * p, [None] * p
    done = set()
    for t in range(sched.num_steps):
        send_act, send_grad = [None] * p, [None] * p
        for r in range(p):
            slot = tab["recv_grad"][t, r]
            assert (in_grad[r] is None) == (slot == plan.grad_slots), (t, r, in_grad[r])
            grads[r][slot] = in_grad[r]
            code = tab["k_kind"][t, r]
            if code != IDLE:
                is_w = code > W_OFFSET
                kind = code - W_OFFSET if is_w else code
                mb, s = tab["k_mb"][t, r], tab["k_stage"][t, r] * p + r
                assert kind == stage_kind(s, S)
                if s > 0:
                    assert acts[r][tab["k_slot"][t, r]] == (mb, s)
                if s < S - 1:
                    assert grads[r][tab["k_gslot"][t, r]] == (mb, s)
                if not is_w and s > 0:
                    send_grad[r] = (mb, s - 1)
                done.add(("W" if is_w else "B", mb, s))
            slot = tab["recv_act"][t, r]
            assert (in_act[r] is None) == (slot == plan.act_slots), (t, r, in_act[r])
            acts[r][slot] = in_act[r]
            if tab["f_kind"][t, r] != IDLE:
                mb, s = tab["f_mb"][t, r], tab["f_stage"][t, r] * p + r
                assert tab["f_kind"][t, r] == stage_kind(s, S)
                if s > 0:
                    assert acts[r][tab["f_slot"][t, r]] == (mb, s)
                if s < S - 1:
                    send_act[r] = (mb, s + 1)
                done.add(("F", mb, s))
        in_act = [send_act[(r - 1) % p] for r in range(p)]
        in_grad = [send_grad[(r + 1) % p] for r in range(p)]
    m = sched.num_microbatches
    kinds = ("F", "B", "W") if split else ("F", "B")
    assert done == {(k, mb, s) for k in kinds for mb in range(m) for s in range(S)}


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_replay_reads_the_right_values(name, p, m, v):
    replay(build_plan(make_schedule(name, p, m, v)))


@pytest.mark.parametrize("m", [1, 4, 8, 32])
def test_stash_bounds(m):
    p = 4
    one_f_one_b = build_plan(make_schedule("1f1b", p, m))
    gpipe = build_plan(make_schedule("gpipe", p, m))
    # Rank 0 runs stage 0, whose input is tokens: nothing to stash.
    assert stash_depth(one_f_one_b) == [0] + [min(m, 2 * (p - r) - 1) for r in range(1, p)]
    assert stash_depth(gpipe) == [0] + [m] * (p - 1)
    assert one_f_one_b.act_slots == min(m, 2 * p - 3) and gpipe.act_slots == m
    zb = build_plan(make_schedule("zb_h1", p, m))
    assert max(stash_depth(zb)) <= p
