"""Pipeline schedule tables: generators pass the validator, broken tables fail it, bubbles match
theory; the schedule records and stage maps other than `s % p` (V-shaped tables)."""

import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from jaxpar.parallel.pipeline.checks import peak_in_flight, validate
from jaxpar.parallel.pipeline.schedules import (
    SCHEDULE_NAMES,
    SCHEDULES,
    from_programs,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    schedule_kind,
    theoretical_bubble,
    zb_h1,
)
from jaxpar.parallel.pipeline.table import (
    Action,
    B,
    F,
    Schedule,
    W,
    action_cost,
    bubble_fraction,
    modular_stages,
    parse,
    render,
    step_costs,
)
from tests.support.v_shape import v_stages, v_table

PM = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 13), (8, 8), (8, 24)]
PMV = [(1, 2, 3), (2, 2, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (8, 16, 2)]
ZB_PM = [(p, m) for p, m in PM if m >= p]


def exact_bubble(s: Schedule) -> Fraction:
    total = int(step_costs(s).sum())
    split = s.split_backward
    works = {sum(action_cost(a.kind, split) for row in s.grid for a in row[r]) for r in range(s.num_ranks)}
    (work,) = works  # every rank does the same work
    return 1 - Fraction(work, total)


def edit(s: Schedule, remove=(), add=()) -> Schedule:
    """A copy of `s` with (step, rank, Action) entries removed and added; grows the grid if needed."""
    grid = [[list(cell) for cell in row] for row in s.grid]
    for t, r, a in remove:
        grid[t][r].remove(a)
    for t, r, a in add:
        while len(grid) <= t:
            grid.append([[] for _ in range(s.num_ranks)])
        grid[t][r].append(a)
    return Schedule(s.name, s.num_ranks, s.num_microbatches, s.virtual_stages, s.split_backward, grid, s.stages)


def find(s: Schedule, rank: int, action: Action) -> int:
    (step,) = [t for t, row in enumerate(s.grid) if action in row[rank]]
    return step


# --- generators --------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", PM)
def test_gpipe_and_1f1b_validate(p, m):
    for s in (gpipe(p, m), one_f_one_b(p, m), make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)):
        validate(s)
        assert not s.split_backward and s.virtual_stages == 1


@pytest.mark.parametrize("p,m,v", PMV)
def test_interleaved_validates(p, m, v):
    s = interleaved_1f1b(p, m, v)
    validate(s)
    assert s.num_stages == p * v and make_schedule("interleaved_1f1b", p, m, v).grid == s.grid


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_validates(p, m):
    s = zb_h1(p, m)
    validate(s)
    assert s.split_backward
    # One action per cell: with F = B = W = 1 every step then costs exactly 1.
    assert all(len(cell) <= 1 for row in s.grid for cell in row)


def test_make_schedule_errors():
    valid = "valid: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, dualpipev"
    with pytest.raises(ValueError, match=f"unknown pipeline schedule 'pipedream'; {valid}$"):
        make_schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match=r"parallel.num_microbatches=6 must be a multiple of mesh.pipeline=4"):
        make_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match=r"must be a multiple of mesh.pipeline=4"):
        interleaved_1f1b(4, 6, 2)  # the builder alone refuses too
    with pytest.raises(ValueError, match="parallel.virtual_stages=2 needs parallel.pipeline_schedule='interleaved_1f1b'"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        gpipe(4, 0)


# --- records -----------------------------------------------------------------------------------


def test_records():
    names = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipev")
    assert SCHEDULE_NAMES == names == tuple(k.name for k in SCHEDULES)
    for kind in SCHEDULES:
        assert schedule_kind(kind.name) is kind and schedule_kind(kind) is kind
        v = 2 if kind.accepts(2) else 1
        table = kind.table(4, 8, v)
        validate(table)
        assert (table.name, table.split_backward, table.stages) == (kind.name, kind.split_backward, kind.stages(4, v))
        assert make_schedule(kind.name, 4, 8, v) == table
        assert theoretical_bubble(kind.name, 4, 8, v) == kind.bubble(4, 8, v)
    assert [k.name for k in SCHEDULES if k.accepts(3)] == ["interleaved_1f1b"]
    assert [k.name for k in SCHEDULES if k.split_backward] == ["zb_h1", "zb_v", "dualpipev"]
    assert [k.name for k in SCHEDULES if k.stages(4, 2) != modular_stages(4, 2)] == ["zb_v", "dualpipev"]
    # Constraints are one line each and name the config keys.
    assert [k.constraints(4, 6, 2) for k in SCHEDULES] == [
        [], [], ["parallel.num_microbatches=6 must be a multiple of mesh.pipeline=4 for interleaved_1f1b"], [], [],
        ["parallel.num_microbatches=6 must be at least 2 × mesh.pipeline=8 for dualpipev"],
    ]
    assert schedule_kind("zb_v").constraints(4, 3, 2) == ["parallel.num_microbatches=3 must be at least mesh.pipeline=4 for zb_v"]
    problem = schedule_kind("zb_h1").virtual_stage_problem(2)
    assert problem == (
        "parallel.virtual_stages=2 needs parallel.pipeline_schedule='interleaved_1f1b' or 'zb_v' or 'dualpipev' "
        "('zb_h1' takes 1)"
    )
    problem = schedule_kind("zb_v").virtual_stage_problem(1)
    assert problem == "parallel.virtual_stages=1 must be 2 for parallel.pipeline_schedule='zb_v'"
    with pytest.raises(ValueError, match=rf"^unknown pipeline schedule 'v'; valid: {', '.join(names)}$"):
        schedule_kind("v")


# --- stage maps other than s % p ------------------------------------------------------------------


def test_stage_map_of_a_v_shaped_table():
    s = v_table(4, 8)
    validate(s)
    assert s.stages == v_stages(4) == ((0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1))
    assert not s.modular and make_schedule("1f1b", 4, 8).modular
    for stage in range(s.num_stages):
        assert s.global_stage(*s.locate(stage)) == stage
    # Hops: +1 down the ranks, 0 on rank 3 (stages 3 -> 4), -1 (= 3 mod 4) back up.
    assert [(h.distance, h.pairs) for h in s.hops] == [(0, ()), (1, ((0, 1), (1, 2), (2, 3))), (3, ((1, 0), (2, 1), (3, 2)))]
    assert [h.distance for h in make_schedule("interleaved_1f1b", 4, 8, 2).hops] == [1]
    # Every rank runs each of its two stages' F and B for every microbatch.
    for r in range(4):
        assert sorted((a.kind, a.mb, a.vstage) for row in s.grid for a in row[r]) == sorted(
            (k, mb, u) for k in (F, B) for mb in range(8) for u in range(2)
        )


def test_stage_map_must_be_a_bijection():
    with pytest.raises(ValueError, match="must place the 4 stages on every"):
        Schedule("bad", 2, 1, 2, False, [], stages=((0, 0), (1, 0), (1, 0), (0, 1)))


def test_parse_inverts_render_with_a_stage_map():
    for s in (v_table(2, 4), v_table(3, 3, split_backward=True, order="gpipe")):
        text = render(s)
        assert "stages=0.0,1.0," in text.splitlines()[0]
        assert parse(text) == s
    assert "stages=" not in render(make_schedule("1f1b", 2, 2))  # the modular map is the default


def test_validator_follows_the_stage_map():
    """The same grid read with the modular map is invalid (positive control). With its V map a
    hop that stays on a rank (stage 1 -> 2, both on rank 1) still needs a step, and a missing
    action is reported on the rank the map gives it."""
    s = v_table(2, 2)
    with pytest.raises(ValueError, match="invalid pipeline schedule"):
        validate(Schedule(s.name, 2, 2, 2, False, s.grid))
    t1, t2 = find(s, 1, Action(F, 0, 0)), find(s, 1, Action(F, 0, 1))
    assert t1 < t2
    same_step = edit(s, remove=[(t2, 1, Action(F, 0, 1))], add=[(t1, 1, Action(F, 0, 1))])
    with pytest.raises(ValueError, match=late(f"F(mb=0, stage=2) at step {t1}, rank 1", f"F(mb=0, stage=1) at step {t1}")):
        validate(same_step)
    with pytest.raises(ValueError, match=re.escape("F(mb=0, stage=2) is missing (rank 1)")):
        validate(edit(s, remove=[(t2, 1, Action(F, 0, 1))]))


def test_from_programs_refuses_a_contradictory_order():
    # Rank 0 wants stage 3's forward (its local 1) before stage 0's: nothing can move.
    programs = [[Action(F, 0, 1), Action(F, 0, 0)], [Action(F, 0, 0), Action(F, 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlocked at step 0"):
        from_programs("x", 2, 1, 2, programs, stages=v_stages(2))


# --- render and parse ------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 3, 5, 1), ("interleaved_1f1b", 4, 8, 2), ("zb_h1", 4, 8, 1)])
def test_parse_inverts_render(name, p, m, v):
    s = make_schedule(name, p, m, v)
    assert parse(render(s)) == s


def test_parse_states_a_table_literally():
    s = parse("""
        gpipe: p=2 m=2 v=1, 6 steps
        step  0  1  2  3  4  5
        r0   F0 F1  .  . B0 B1
        r1    . F0 F1 B0 B1  .
        cost  1  1  1  2  2  2
    """)
    assert s == gpipe(2, 2)
    assert s.grid[3][1] == (Action(B, 0),)
    with pytest.raises(ValueError, match="cannot read cell 'X1'"):
        parse(render(gpipe(2, 2)).replace("F1", "X1", 1))


def test_render():
    text = render(one_f_one_b(4, 8))
    lines = text.splitlines()
    assert len(lines) == 1 + 1 + 4 + 1  # title, step numbers, one row per rank, cost
    assert lines[2].split()[:4] == ["r0", "F0", "F1", "F2"]
    assert lines[5].split()[:6] == ["r3", ".", ".", ".", "F0", "F1B0"]
    assert "F3.1" in render(interleaved_1f1b(4, 8, 2)) and "W7" in render(zb_h1(4, 8))


# --- bubble ------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", PM)
def test_gpipe_1f1b_bubble_equals_theory(p, m):
    for name in ("gpipe", "1f1b"):
        s = make_schedule(name, p, m)
        # GPipe: m+p-1 F-only steps (cost 1) + m+p-1 B-only steps (cost 2).
        # 1F1B: p F-only steps + (m-1) steps with F+B on the last rank (cost 3) + p B-only steps.
        assert int(step_costs(s).sum()) == 3 * (m + p - 1)
        assert exact_bubble(s) == Fraction(p - 1, m + p - 1)
        assert bubble_fraction(s) == pytest.approx(theoretical_bubble(name, p, m), abs=1e-12)


@pytest.mark.parametrize("p,m,v", PMV)
def test_interleaved_bubble_equals_theory(p, m, v):
    s = interleaved_1f1b(p, m, v)
    # Steps 0..vp-1 hold only F's (cost 1), the last vp only B's (cost 2) and the mv+p-1-vp steps
    # between hold F+B on rank p-1 (cost 3): 3(mv+p-1) chunk units for 3mv of work per rank, so the
    # table matches (p-1)/(vm+p-1) exactly (it needs m >= p, guaranteed by m % p == 0).
    assert int(step_costs(s).sum()) == 3 * (m * v + p - 1)
    assert exact_bubble(s) == Fraction(p - 1, v * m + p - 1)
    assert bubble_fraction(s) == pytest.approx(theoretical_bubble("interleaved_1f1b", p, m, v), abs=1e-12)


@pytest.mark.parametrize("p,m", ZB_PM)
def test_zb_h1_bubble_equals_theory(p, m):
    s = zb_h1(p, m)
    # Every step costs 1, so total time = steps. Rank p-1 first works at step p-1 and is then busy
    # until the end (3m actions): 3m + p - 1 steps, i.e. Qi et al.'s (p-1)(T_F+T_B-T_W) = p-1
    # units of bubble with T_F = T_B = T_W = 1.
    assert s.num_steps == int(step_costs(s).sum()) == 3 * m + p - 1
    assert exact_bubble(s) == Fraction(p - 1, 3 * m + p - 1)
    assert bubble_fraction(s) == pytest.approx(theoretical_bubble("zb_h1", p, m), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 3), (8, 5)])
def test_zb_h1_few_microbatches(p, m):
    # m < p (outside the paper's m >= p assumption): the last rank alternates F, B, so F(m-1) reaches
    # it at step (p-1) + 2(m-1), B(m-1) one step later, reaches rank 0 p-1 steps after, then W:
    # 2m + 2p - 1 steps.
    assert zb_h1(p, m).num_steps == 2 * m + 2 * p - 1


# --- stash depth -------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", PM)
def test_peak_in_flight(p, m):
    assert peak_in_flight(gpipe(p, m)) == [m] * p
    # Lockstep 1F1B: a microbatch returns to rank r 2(p-r)-1 steps after its F there, and the
    # steady state starts one F per step, so rank r stashes 2(p-r)-1 (not MPMD 1F1B's p-r; holding
    # it at p-r costs steady-state bubble, see `one_f_one_b`). Bounded by 2p-1 whatever m is.
    assert peak_in_flight(one_f_one_b(p, m)) == [min(m, 2 * (p - r) - 1) for r in range(p)]
    if m >= 2 * p:
        assert max(peak_in_flight(one_f_one_b(p, m))) < m == max(peak_in_flight(gpipe(p, m)))


@pytest.mark.parametrize("p,m", ZB_PM)
def test_zb_h1_peak_in_flight_is_1f1b_rank0(p, m):
    # ZB-H1 keeps every rank at p stashes (F done, W not yet done): MPMD 1F1B's rank-0 peak.
    assert peak_in_flight(zb_h1(p, m)) == [p] * p


@pytest.mark.parametrize("p,m,v", PMV)
def test_interleaved_peak_in_flight(p, m, v):
    # Megatron's interleaved warm-up: (v-1)p + 2(p-r-1) chunks, plus the one in flight.
    expected = [min(m * v, (v - 1) * p + 2 * (p - r) - 1) for r in range(p)]
    assert peak_in_flight(interleaved_1f1b(p, m, v)) == expected


# --- validator rejects broken tables -----------------------------------------------------------


def late(first: str, second: str) -> str:
    """Regex for the message '<first> must come at least one step after <second>'."""
    return re.escape(first) + ".* must come at least one step after " + re.escape(second)


def tiny(split=False) -> Schedule:
    """p=2, m=1: F0 on r0 at 0, F0 on r1 at 1, B0 on r1 at 2, B0 on r0 at 3 (W's at 4 and 3)."""
    grid = [[[Action(F, 0)], []], [[], [Action(F, 0)]], [[], [Action(B, 0)]], [[Action(B, 0)], []]]
    s = Schedule("tiny", 2, 1, 1, split, grid)
    if split:
        s = edit(s, add=[(3, 1, Action(W, 0)), (4, 0, Action(W, 0))])
    validate(s)
    return s


def test_rejects_missing_action():
    s = one_f_one_b(4, 8)
    bad = edit(s, remove=[(find(s, 2, Action(B, 3)), 2, Action(B, 3))])
    with pytest.raises(ValueError, match=r"B\(mb=3, stage=2\) is missing"):
        validate(bad)


def test_rejects_duplicated_action():
    s = one_f_one_b(4, 8)
    bad = edit(s, add=[(0, 1, Action(F, 5))])  # rank 1 is idle at step 0
    message = "F(mb=5, stage=1) appears 2 times: step 0, rank 1; step 6, rank 1"
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(bad)


def test_rejects_backward_before_forward():
    s = one_f_one_b(4, 8)  # last rank: F0 at step 3, B0 at step 4; put B0 into F0's cell
    bad = edit(s, remove=[(4, 3, Action(B, 0))], add=[(3, 3, Action(B, 0))])
    message = late("B(mb=0, stage=3) at step 3", "F(mb=0, stage=3) at step 3") + ".*own forward"
    with pytest.raises(ValueError, match=message):
        validate(bad)


def test_rejects_forward_transfer_violation():
    s = one_f_one_b(4, 8)  # rank 1 runs F0 at step 0, the step rank 0 produces it
    bad = edit(s, remove=[(1, 1, Action(F, 0))], add=[(0, 1, Action(F, 0))])
    message = late("F(mb=0, stage=1) at step 0, rank 1", "F(mb=0, stage=0) at step 0")
    with pytest.raises(ValueError, match=message):
        validate(bad)


def test_rejects_backward_transfer_violation():
    bad = edit(tiny(), remove=[(3, 0, Action(B, 0))], add=[(2, 0, Action(B, 0))])
    message = late("B(mb=0, stage=0) at step 2, rank 0", "B(mb=0, stage=1) at step 2")
    with pytest.raises(ValueError, match=message):
        validate(bad)


def test_rejects_same_rank_virtual_stage_order():
    # p=1, v=2: stage 1 lives on the same rank as stage 0 and still needs it a step earlier.
    grid = [[[Action(F, 0, 1)]], [[Action(F, 0, 0)]], [[Action(B, 0, 1)]], [[Action(B, 0, 0)]]]
    message = late("F(mb=0, stage=1) at step 0, rank 0", "F(mb=0, stage=0) at step 1")
    with pytest.raises(ValueError, match=message):
        validate(Schedule("chain", 1, 1, 2, False, grid))
    validate(interleaved_1f1b(1, 2, 2))


def test_rejects_two_forwards_in_one_cell():
    s = one_f_one_b(4, 8)  # move rank 1's F1 (step 2) into its step-1 cell next to F0
    bad = edit(s, remove=[(2, 1, Action(F, 1))], add=[(1, 1, Action(F, 1))])
    with pytest.raises(ValueError, match=r"step 1, rank 1: 2 forward actions F0\+F1 in one cell"):
        validate(bad)


def test_rejects_b_and_w_in_one_cell():
    bad = edit(tiny(split=True), remove=[(3, 1, Action(W, 0))], add=[(2, 1, Action(W, 0))])
    with pytest.raises(ValueError, match=r"step 2, rank 1: 2 backward-type actions B0\+W0 in one cell"):
        validate(bad)


def test_rejects_w_before_b_and_w_without_split():
    bad = edit(tiny(split=True), remove=[(4, 0, Action(W, 0))], add=[(2, 0, Action(W, 0))])
    message = late("W(mb=0, stage=0) at step 2, rank 0", "B(mb=0, stage=0) at step 3")
    with pytest.raises(ValueError, match=message):
        validate(bad)
    with pytest.raises(ValueError, match="W action but split_backward is False"):
        validate(edit(tiny(), add=[(4, 0, Action(W, 0))]))


def test_rejects_bad_shapes_and_indices():
    with pytest.raises(ValueError, match="step 0 has 1 cells, expected one per rank"):
        validate(Schedule("short", 2, 1, 1, False, [[[Action(F, 0)]]]))
    with pytest.raises(ValueError, match="F mb=1 vstage=0 is outside mb < 1"):
        validate(edit(tiny(), add=[(4, 0, Action(F, 1))]))


# --- script ------------------------------------------------------------------------------------


def test_script_prints_table_bubble_and_peaks():
    script = Path(__file__).resolve().parents[3] / "scripts" / "pipeline.py"
    out = subprocess.run(
        [sys.executable, str(script), "schedule", "--schedule=interleaved_1f1b", "--stages=4", "--microbatches=8"]
        + ["--virtual_stages=2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "F7.0B0.1" in out and "peak in-flight" in out
    bubble = f"{theoretical_bubble('interleaved_1f1b', 4, 8, 2):.4f}"
    assert out.count(bubble) == 2  # table and theory lines agree
