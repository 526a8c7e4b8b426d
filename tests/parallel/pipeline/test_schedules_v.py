"""The V-shaped schedules `zb_v` and `dualpipev` (`jaxpar/parallel/pipeline/vshape.py`): valid
tables on the V stage map, their time and peak stash against the papers' numbers, paired F & B
cells, the text form and the drawing script. Pure Python, no devices.

Units: a chunk (one of a rank's two stages) per microbatch, F = B = W = 1; a cell costs the sum of
its actions; a step lasts as long as its busiest cell (`table.step_costs`).
- ZB-V (Qi et al.): bubble-free at T_F = T_B = T_W once the start-up skew is hidden across
  iterations; a synchronous step pays the skew, p - 1 steps: 6m + p - 1 in all, the least any
  lockstep table can take (the last rank's first action is at step p - 1 and it has 6m units).
  Stash: 1F1B's p microbatches of a whole rank's layers = 2p chunk inputs.
- DualPipeV (DeepSeek-V3's DualPipe, one direction): bubble (PP/2 - 1)(F&B + B - 3W), PP = 2p
  chunks, = 0 with F&B = F + B; activations PP + 1 = 2p + 1 chunk inputs; m >= 2p.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.parallel.pipeline.checks import peak_in_flight, validate
from jaxpar.parallel.pipeline.programs import from_programs
from jaxpar.parallel.pipeline.schedules import make_schedule, theoretical_bubble
from jaxpar.parallel.pipeline.table import Action, B, F, bubble_fraction, parse, render, step_costs
from jaxpar.parallel.pipeline.vshape import dualpipev, v_stages, zb_v

ZB_V_PM = [(p, m) for p in range(1, 9) for m in sorted({p, p + 1, 2 * p, 3 * p + 1})]
DUALPIPEV_PM = [(p, m) for p in range(1, 9) for m in sorted({2 * p, 2 * p + 1, 4 * p})]


def total(s) -> int:
    return int(step_costs(s).sum())


@pytest.mark.parametrize("p, m", ZB_V_PM)
def test_zb_v_time_and_stash_against_the_paper(p, m):
    s = zb_v(p, m)
    validate(s)
    assert s.stages == v_stages(p) and s.split_backward and set(step_costs(s)) == {1}  # one action per cell
    skew = p - 1  # the lower bound: 6m units per rank after the last rank's first p - 1 idle steps
    # Equal to the bound at p <= 4; at p = 5..8 the list scheduler takes up to p - 4 steps more.
    assert 6 * m + skew <= s.num_steps <= 6 * m + skew + max(0, p - 4)
    if p <= 4:
        assert bubble_fraction(s) == pytest.approx(theoretical_bubble("zb_v", p, m, 2)) == (p - 1) / (6 * m + p - 1)
    peak = peak_in_flight(s)
    assert max(peak) <= 2 * p and peak[0] == min(2 * m, 2 * p)  # 1F1B's p microbatches, in chunks


@pytest.mark.parametrize("p, m", DUALPIPEV_PM)
def test_dualpipev_time_and_stash_against_deepseek(p, m):
    s = dualpipev(p, m)
    validate(s)
    assert s.stages == v_stages(p) and s.split_backward
    # DeepSeek's bubble (p - 1)(F&B + B - 3W) = 0 at F&B = F + B = 2, B = W = 1; the table adds the
    # start-up skew (p - 1, as zb_v) and p - 1 lockstep steps where one rank's F & B (cost 2) holds
    # the others' single actions.
    assert total(s) == 6 * m + 2 * (p - 1)
    assert bubble_fraction(s) == pytest.approx(2 * (p - 1) / (6 * m + 2 * (p - 1)))
    assert peak_in_flight(s) == [2 * p + 1] * p  # DeepSeek: PP + 1 with PP = 2p chunks
    # The steady state pairs one microbatch's F with another's B in one cell: m - 2p + r + 1 pairs
    # of such cells on rank r, plus p - r - 1 in the cool-down.
    for r in range(p):
        pairs = [cell for row in s.grid for cell in [row[r]] if len(cell) == 2]
        assert all({a.kind for a in cell} == {F, B} and cell[0].mb != cell[1].mb for cell in pairs)
        assert len(pairs) == 2 * (m - 2 * p + r + 1) + (p - r - 1)


def test_v_bubbles_beat_the_other_schedules():
    """At the same (p, m) and the same work per rank, in the lockstep model (the idle fraction is unit-free)."""
    p, m = 4, 8
    bubbles = {name: bubble_fraction(make_schedule(name, p, m, v)) for name, v in
               (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipev", 2))}
    assert bubbles["zb_v"] < bubbles["dualpipev"] < bubbles["interleaved_1f1b"] < bubbles["1f1b"]
    # In lockstep DualPipeV's 2(p - 1) / (6m + 2(p - 1)) is exactly ZB-H1's (p - 1) / (3m + p - 1).
    assert bubbles["dualpipev"] == pytest.approx(bubbles["zb_h1"])


def test_v_hops_and_ends():
    for s in (zb_v(4, 8), dualpipev(4, 8)):
        assert [h.distance for h in s.hops] == [0, 1, 3]  # on rank 3, down, back up (-1)
        assert s.locate(0) == (0, 0) and s.locate(7) == (0, 1)  # both ends on rank 0
    assert [h.distance for h in zb_v(2, 4).hops] == [0, 1]  # p = 2: down and back up are one distance


def test_preflight_constraints():
    with pytest.raises(ValueError, match=r"num_microbatches=7 must be at least 2 × mesh.pipeline=8 for dualpipev"):
        make_schedule("dualpipev", 4, 7, 2)
    with pytest.raises(ValueError, match=r"num_microbatches=3 must be at least mesh.pipeline=4 for zb_v"):
        make_schedule("zb_v", 4, 3, 2)
    with pytest.raises(ValueError, match=r"virtual_stages=1 must be 2 for parallel.pipeline_schedule='zb_v'"):
        make_schedule("zb_v", 4, 8, 1)
    with pytest.raises(ValueError, match="at least 2"):
        dualpipev(2, 3)  # the builder alone refuses too


def test_paired_program_items_wait_for_both_actions():
    """`from_programs` runs a (F, B) item only when both are ready: here B of stage 1 (the last)
    needs its own F one step earlier, so the pair (F1, B0) of rank 1 waits."""
    programs = [[Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)],
                [Action(F, 0), (Action(F, 1), Action(B, 0)), Action(B, 1)]]
    s = from_programs("pairs", 2, 2, 1, programs)
    validate(s)
    (t,) = [t for t, row in enumerate(s.grid) if len(row[1]) == 2]
    assert t == 2 and set(s.grid[t][1]) == {Action(F, 1), Action(B, 0)}


@pytest.mark.parametrize("name, p, m", [("zb_v", 3, 4), ("dualpipev", 2, 5)])
def test_parse_inverts_render(name, p, m):
    s = make_schedule(name, p, m, 2)
    assert parse(render(s)) == s


def test_script_draws_the_v_schedules():
    script = Path(__file__).resolve().parents[3] / "scripts" / "pipeline.py"
    for name in ("zb_v", "dualpipev"):
        out = subprocess.run([sys.executable, str(script), "schedule", f"--schedule={name}", "--stages=4", "--microbatches=8"],
                             capture_output=True, text=True, check=True, timeout=120).stdout
        assert out.startswith(f"{name}: p=4 m=8 v=2 stages=0.0,1.0,2.0,3.0,3.1,2.1,1.1,0.1")
        assert f"bubble (theory):                {theoretical_bubble(name, 4, 8, 2):.4f}" in out
        assert ("F7.0B3.1" in out) == (name == "dualpipev")  # a paired cell
