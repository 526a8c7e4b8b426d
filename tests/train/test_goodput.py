"""Goodput (`jaxpar.train.goodput`) against theory.

Through the training loop: a run that crashes after step 5 (its last checkpoint at step 3), then
the start that resumes it. The independent references are the runs' own metrics.jsonl lines and
the clock around `train()`:
- each start's kinds sum to its wall time, which lies inside the time `train()` took;
- productive time is exactly the sum of the steps' `step_s` (the same measurements, no second clock);
- what the crash lost is exactly the `step_s` of the steps it logged after checkpoint 3 (4 and 5),
  moved from productive to lost, so over both starts productive is the sum of `step_s` over the
  final metrics.jsonl (steps 1..8 once each) — nothing counted twice;
- the end's metrics.jsonl record holds the ledger's numbers; the restart and end lines say them,
  and so does scripts/goodput.py's table.
Without the loop, the accounting of crashed starts in closed form: a kill inside a step (lost), a
fallback to an older checkpoint (more lost, never twice), a kill inside a save (checkpoint time).
"""

import json
import math
import os
import time

import jax
import pytest

from jaxpar.train import goodput
from jaxpar.train.loop import train
from jaxpar.train.nonfinite import NonFiniteGuard
from tests.support import tiny
from tests.train.probe import Probe, script

CRASH_AT = 5


def config():
    c = tiny.llama(vocab_size=256, train={"steps": 8, "peak_flops_per_device": 1e12})
    c.data.max_corpus_bytes = 100_000
    c.checkpoint.every_steps = 3
    c.eval.share, c.eval.every_steps, c.eval.steps = 0.1, 4, 2
    return c


def records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def steps(workdir):
    return {r["step"]: r for r in records(workdir) if "loss" in r}


def timed_train(workdir):
    """(when train() was called, how long it took, what it raised)."""
    started, error = time.time(), None
    try:
        train(config(), workdir, devices=jax.devices()[:1], progress=False)
    except RuntimeError as e:
        error = e
    return started, time.time() - started, error


def assert_sums_to_wall(attempt, started, elapsed, _):
    kinds = goodput.account(attempt)
    wall = attempt["updated"] - attempt["started"]
    assert math.isclose(sum(kinds.values()), wall, rel_tol=1e-9), (kinds, wall)
    assert started <= attempt["started"] and attempt["updated"] <= started + elapsed, "the start's wall lies inside train()"
    assert min(kinds.values()) >= 0 and kinds["compile"] > 0 and kinds["eval"] > 0 and kinds["checkpoint"] > 0


def test_a_crash_and_its_restart_account_every_second_once(tmp_path, monkeypatch, capsys):
    workdir = str(tmp_path / "run")
    observe = NonFiniteGuard.observe

    def crashing(self, step, metrics):  # after step 5 is logged, before anything saves it
        if step == CRASH_AT:
            raise RuntimeError("planted crash")
        observe(self, step, metrics)

    monkeypatch.setattr(NonFiniteGuard, "observe", crashing)
    first_call = timed_train(workdir)
    assert str(first_call[2]) == "planted crash"
    crashed = steps(workdir)
    assert sorted(crashed) == [1, 2, 3, 4, 5] and sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
    (attempt,) = goodput.read(workdir)
    assert attempt["ended"] == "RuntimeError" and attempt["last_step"] == CRASH_AT
    assert math.isclose(attempt["seconds"]["productive"], sum(r["step_s"] for r in crashed.values()), rel_tol=1e-12)
    assert_sums_to_wall(attempt, *first_call)
    capsys.readouterr()

    monkeypatch.setattr(NonFiniteGuard, "observe", observe)
    second_call = timed_train(workdir)
    assert second_call[2] is None
    out = capsys.readouterr().out
    first, second = goodput.read(workdir)
    lost = crashed[4]["step_s"] + crashed[5]["step_s"]
    assert math.isclose(first["seconds"]["lost"], lost, rel_tol=1e-12), "the steps after checkpoint 3, as measured"
    assert math.isclose(first["seconds"]["productive"], sum(crashed[s]["step_s"] for s in (1, 2, 3)), rel_tol=1e-12)
    assert f"the fault before this start lost {lost:.1f} s of training (steps 4-5," in out
    assert_sums_to_wall(second, *second_call)
    assert second["first_step"] == 3 and second["last_step"] == 8 and second["ended"] == "done"

    final = steps(workdir)
    assert sorted(final) == list(range(1, 9))
    total = goodput.totals([first, second])
    assert math.isclose(total["productive"], sum(r["step_s"] for r in final.values()), rel_tol=1e-12), "nothing twice"
    assert math.isclose(total["wall"], second["updated"] - first["started"], rel_tol=1e-9)
    assert math.isclose(total["restart"], second["started"] - first["updated"], rel_tol=1e-9)

    record = [r for r in records(workdir) if "goodput" in r][-1]
    assert record["step"] == 8 and record["goodput_starts"] == 2
    for kind in ("productive", "lost", "compile", "eval", "restore"):
        assert math.isclose(record[f"goodput_{kind}_s"], total[kind], rel_tol=1e-12), kind
    # The record is taken just before the ledger's last write, so its wall is a little shorter.
    assert record["goodput"] == pytest.approx(record["goodput_productive_s"] / record["goodput_wall_s"], rel=1e-12)
    assert record["goodput_wall_s"] <= total["wall"]
    assert f"goodput over 2 starts: {100 * record['goodput']:.1f}% of {record['goodput_wall_s']:.1f} s" in out

    # scripts/goodput.py: a row per start and one for the run, as the ledger says; the plot written.
    capsys.readouterr()
    assert script("goodput").main([workdir, f"--out={tmp_path / 'goodput.png'}"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].startswith("1: steps 1-5") and table[1].rstrip().endswith("RuntimeError")
    assert table[2].startswith("2: steps 4-8") and table[2].rstrip().endswith("done")
    assert table[3].split()[:3] == ["all", f"{total['wall']:.1f}", f"{100 * total['productive'] / total['wall']:.1f}%"]
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def attempt(**fields):
    base = {"started": 100.0, "updated": 200.0, "ended": None, "first_step": 0, "last_step": 10, "trained_s": 50.0,
            "seconds": {"productive": 50.0, "compile": 20.0}, "marks": {"4": 20.0, "8": 40.0}, "current": None,
            "current_since": None}
    return {**base, **fields}


def test_crashed_starts_in_closed_form():
    # Killed 3 s into a step after step 10, resumed from checkpoint 8: steps 9-10 (10 s) and the step in flight.
    a = attempt(current="productive", current_since=197.0)
    assert goodput.charge_lost([a], 8) == (13.0, 9, 11)
    kinds = goodput.account(a)
    assert (kinds["productive"], kinds["lost"], kinds["compile"], kinds["other"]) == (40.0, 13.0, 20.0, 27.0)
    assert sum(kinds.values()) == 100.0
    # Checkpoint 8 then proved unreadable: the next start resumes from 4; only the difference is new.
    assert goodput.charge_lost([a], 4) == (20.0, 5, 10)
    assert goodput.account(a)["lost"] == 33.0 and goodput.charge_lost([a], 4) is None, "never charged twice"
    # Killed 5 s into a save: checkpoint time, nothing lost beyond the resume point.
    b = attempt(current="checkpoint", current_since=195.0, last_step=8, trained_s=40.0, seconds={"productive": 40.0})
    assert goodput.charge_lost([b], 8) is None and goodput.account(b)["checkpoint"] == 5.0
    # Two starts and the gap between them.
    later = attempt(started=230.0, updated=300.0, ended="done", first_step=8, last_step=12, trained_s=10.0,
                    seconds={"productive": 10.0}, marks={})
    total = goodput.totals([b, later])
    assert total["restart"] == 30.0 and total["wall"] == 200.0 and total["productive"] == 50.0


@pytest.mark.parametrize("argv, expected", [
    (["missing"], "WORKDIR '{root}/missing' is not a directory"),
    (["empty"], "WORKDIR '{root}/empty' holds no readable goodput.json"),
    (["ledger", "--out={root}/nowhere/g.png"], "--out={root}/nowhere/g.png: the folder"),
], ids=["no_workdir", "no_ledger", "out_folder_missing"])
def test_bad_goodput_input_is_one_line(argv, expected, tmp_path, capsys, monkeypatch):
    probe = Probe(tmp_path, capsys, monkeypatch)
    os.makedirs(tmp_path / "empty")
    probe.write("ledger/goodput.json", json.dumps({"attempts": [attempt(ended="done")]}))
    argv = [str(tmp_path / argv[0]), *(a.format(root=tmp_path) for a in argv[1:])]
    probe.refused("goodput", argv, expected.format(root=tmp_path))
