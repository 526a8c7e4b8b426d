"""The V-shaped schedules: each rank holds two stages, the first going down the ranks and the
second coming back up (`v_stages`: rank r holds stages r and 2p - 1 - r, so stage 0 and the last
stage both sit on rank 0). Both split the backward into B (input gradient) and W (weight gradient)
and cost F = B = W = 1 chunk unit (a chunk: one of a rank's two stages).

`zb_v` (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-V): one action per cell, placed by a
list scheduler that never lets a rank hold more than 2p stashed chunk inputs (p microbatches of a
whole rank's layers: 1F1B's rank-0 peak) and prefers, every step, B (what the chain waits for)
over F over W (which nothing waits for, so it fills the holes). For p <= 4 and every m checked
(`tests/parallel/pipeline/test_schedules_v.py`) that gives 6m + p - 1 steps: each rank's 6m units of work plus the
p - 1 steps the last rank must wait for the first microbatch — the lower bound of any lockstep
table; at p = 5..8 up to p - 4 steps more (a greedy choice, not a proof of optimality). The
paper's zero bubble hides that start-up skew across iterations (optimizer post-validation); a
synchronous step pays it once: bubble (p - 1) / (6m + p - 1).

`dualpipev` (the one-direction DualPipe of DeepSeek-V3, as DeepSeek's `DualPipeV` orders it):
per rank r, 2(p - r - 1) warm-up forwards of chunk 0, r + 1 pairs F0 F1, p - r - 1 rounds B1 W1
F1, then the steady state of cells that overlap one microbatch's forward with another's
backward (F0 & B1, then F1 & B0, each B's W right after), the cool-down of B1 and F1 & B0, r + 1
rounds B1 B0 (the later half with W deferred), p - r - 1 rounds W B0, and the deferred W's.
Needs m >= 2p. Stash: 2p + 1 chunk inputs per rank (DeepSeek: PP + 1, PP = 2p chunks). What
lockstep changes: a paired cell F & B costs F + B (both run on the device in one step; DualPipe's
point, hiding one's communication behind the other's compute, has nothing to hide in a lockstep
step, whose sends all happen at its end), and a step where one rank runs a pair lasts 2 while the
others run single actions: the table takes 6m + 2(p - 1) units, p - 1 more than zb_v (the same
bubble as zb_h1's, with 2p + 1 chunk stashes instead of its 2p). DeepSeek's
bubble (PP/2 - 1)(F&B + B - 3W) = (p - 1)(2 + 1 - 3) = 0 in these units, before the start-up skew.
"""

from __future__ import annotations

from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline.programs import from_programs
from jaxpar.parallel.pipeline.table import Action, B, F, Schedule, StageMap, W, check_sizes, from_placements


def v_stages(p: int, v: int = 2) -> StageMap:
    """Global stage s -> (rank, local index): 0..p-1 down the ranks as local 0, p..2p-1 back up as 1."""
    if v != 2:
        raise ValueError(f"a V shape has 2 virtual stages per rank, got {v}")
    return tuple((s, 0) if s < p else (2 * p - 1 - s, 1) for s in range(2 * p))


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (see the module docstring): 6m + p - 1 unit steps, at most 2p chunk stashes per rank."""
    check_sizes(p, m)
    stages = v_stages(p)
    last, cap = 2 * p - 1, 2 * p
    when = {}  # (kind, mb, global stage) -> step
    next_f, next_b = [0] * (2 * p), [0] * (2 * p)  # per stage, the next microbatch (in order)
    pending_w = [[] for _ in range(p)]  # per rank, (mb, stage) whose B ran, in B order
    live = [0] * p  # stashed chunk inputs: from F to W
    placements, t = [], 0

    def done(key):
        return when.get(key, t) < t

    def pick(r):
        mine = (r, last - r)  # stage r (local 0) and 2p - 1 - r (local 1)
        # Order: B before F before W; among F's the later stage (finishing a microbatch
        # before starting one), among B's the earlier-numbered stage (chunk 1's come first).
        for s in mine:
            if next_b[s] < m and done((B, next_b[s], s + 1) if s < last else (F, next_b[s], s)):
                return B, s, next_b[s]
        if live[r] < cap:
            for s in reversed(mine):
                if next_f[s] < m and (s == 0 or done((F, next_f[s], s - 1))):
                    return F, s, next_f[s]
        if pending_w[r]:  # every pending W's B ran at an earlier step (picks are applied after all ranks chose)
            i, s = pending_w[r][0]
            return W, s, i
        return None

    while len(when) < 6 * m * p:
        picks = [(r, *found) for r in range(p) if (found := pick(r)) is not None]
        for r, kind, s, i in picks:
            when[(kind, i, s)] = t
            placements.append((t, r, Action(kind, i, stages[s][1])))
            if kind == F:
                next_f[s] += 1
                live[r] += 1
            elif kind == B:
                next_b[s] += 1
                pending_w[r].append((i, s))
            else:
                pending_w[r].remove((i, s))  # the first: W's run in B order
                live[r] -= 1
        t += 1
    return from_placements("zb_v", p, m, 2, True, placements, stages)


def _dualpipev_program(p: int, m: int, r: int) -> list:
    count = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}
    weights = []  # W's owed, in B order

    def f(u):
        count[F, u] += 1
        return Action(F, count[F, u] - 1, u)

    def b(u):
        count[B, u] += 1
        weights.append(Action(W, count[B, u] - 1, u))
        return Action(B, count[B, u] - 1, u)

    def w():
        return weights.pop(0)

    program = [f(0) for _ in range(2 * (p - r - 1))]
    for _ in range(r + 1):
        program += [f(0), f(1)]
    for _ in range(p - r - 1):
        program += [b(1), w(), f(1)]
    for _ in range(m - 2 * p + r + 1):  # the steady state: F of one microbatch with B of another
        program += [(f(0), b(1)), w(), (f(1), b(0)), w()]
    for _ in range(p - r - 1):
        program += [b(1), w(), (f(1), b(0)), w()]
    deferred = False  # the second half of these B's leave their W for later (zero-bubble cool-down)
    for i in range(r + 1):
        deferred |= i == (r + 1) // 2 and r % 2 == 1
        program += [b(1)] + ([] if deferred else [w()])
        deferred |= i == (r + 1) // 2 and r % 2 == 0
        program += [b(0)] + ([] if deferred else [w()])
    for _ in range(p - r - 1):
        program += [w(), b(0)]
    return program + [w() for _ in range(len(weights))]


def _dualpipev_constraints(p: int, m: int, v: int) -> list[str]:
    if m < 2 * p:
        return [f"parallel.num_microbatches={m} must be at least 2 × mesh.{PIPELINE}={2 * p} for dualpipev"]
    return []


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (see the module docstring): m >= 2p, 6m + 2(p - 1) units, 2p + 1 chunk stashes per rank."""
    check_sizes(p, m)
    if problems := _dualpipev_constraints(p, m, 2):
        raise ValueError(problems[0])
    programs = [_dualpipev_program(p, m, r) for r in range(p)]
    return from_programs("dualpipev", p, m, 2, programs, split_backward=True, stages=v_stages(p))
