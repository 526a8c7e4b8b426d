"""Two checkpoint tiers (`jaxpar.checkpoint.tiers`): a frequent local one, the persistent one.

A run with checkpoint.every_steps=4 and a local tier every 2 steps crashes after step 7, before any
save of it. Reference: the same run uninterrupted. The rerun resumes from the newest complete step
of either tier — local step 6, not persistent step 4 — and its metrics equal the reference's
bitwise. A damaged local step (a file truncated) or a local tier that is gone (a replaced node) falls
back: to the next newest step of either tier. The bad settings are one line each.
"""

import json
import os
import shutil

import jax
import pytest

from jaxpar.train.loop import train
from jaxpar.train.nonfinite import NonFiniteGuard
from jaxpar.train.observe import TIMING_FIELDS
from jaxpar.train.preflight import ConfigError, check_run
from tests.support import tiny

CRASH_AFTER, STEPS = 7, 10


def config(local_dir):
    c = tiny.llama(vocab_size=256, train={"steps": STEPS, "peak_flops_per_device": 1e12})
    c.data.max_corpus_bytes = 100_000
    c.checkpoint.every_steps = 4
    c.checkpoint.local_dir, c.checkpoint.local_every_steps = str(local_dir), 2
    return c


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records if "loss" in r]


def run(workdir, local_dir, crash=False, monkeypatch=None):
    if crash:
        observe = NonFiniteGuard.observe

        def crashing(self, step, metrics):  # after the step is logged, before anything saves it
            if step == CRASH_AFTER:
                raise RuntimeError("planted crash")
            observe(self, step, metrics)

        monkeypatch.setattr(NonFiniteGuard, "observe", crashing)
        with pytest.raises(RuntimeError, match="planted crash"):
            train(config(local_dir), str(workdir), devices=jax.devices()[:1], progress=False)
        monkeypatch.undo()
        return None
    return train(config(local_dir), str(workdir), devices=jax.devices()[:1], progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    run(folder / "run", folder / "local")
    return losses(folder / "run")


def crashed(tmp_path, monkeypatch):
    workdir, local = tmp_path / "run", tmp_path / "local"
    run(workdir, local, crash=True, monkeypatch=monkeypatch)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]
    assert sorted(n for n in os.listdir(local) if n.isdigit()) == ["2", "6"], "local_keep=2; step 4 went to the persistent tier"
    return workdir, local


@pytest.mark.slow
def test_a_restart_resumes_from_the_newer_local_step_bitwise(tmp_path, monkeypatch, reference, capsys):
    workdir, local = crashed(tmp_path, monkeypatch)
    capsys.readouterr()
    run(workdir, local)
    assert f"resumed from checkpoint {local / '6'} (step 6)" in capsys.readouterr().out
    assert losses(workdir) == reference
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "4", "8"], "the final save is persistent"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "gone"])
def test_a_damaged_or_lost_local_tier_falls_back(tmp_path, monkeypatch, reference, capsys, caplog, damage):
    workdir, local = crashed(tmp_path, monkeypatch)
    if damage == "gone":  # the node was replaced: its disk is empty
        shutil.rmtree(local)
        expected = workdir / "checkpoints" / "4"
    else:
        state = local / "6" / "state"
        biggest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
        expected = workdir / "checkpoints" / "4"  # local 2 is older than persistent 4
    capsys.readouterr()
    run(workdir, local)
    out = capsys.readouterr()
    assert f"resumed from checkpoint {expected} (step 4)" in out.out
    if damage == "truncated":
        assert f"checkpoint {local / '6'} is unreadable" in caplog.text
        assert os.path.isdir(local / "6.unreadable")
    assert losses(workdir) == reference


@pytest.mark.parametrize("keys, line", [
    ({"local_dir": "x"}, "checkpoint.local_dir and checkpoint.local_every_steps go together"),
    ({"local_every_steps": 2}, "checkpoint.local_dir and checkpoint.local_every_steps go together"),
    ({"local_dir": "x", "local_every_steps": -1}, "checkpoint.local_every_steps=-1 must be >= 0"),
    ({"local_dir": "x", "local_every_steps": 2, "local_keep": 0}, "checkpoint.local_keep=0 must be >= 1"),
    ({"local_dir": "WORKDIR/checkpoints/fast", "local_every_steps": 2}, "must lie outside checkpoint.dir"),
    ({"local_dir": "gs://bucket/x", "local_every_steps": 2}, "checkpoint.local_dir=gs://bucket/x must be a local path"),
    ({"local_dir": "FILE", "local_every_steps": 2}, "is a file, not a directory"),
])
def test_bad_local_tier_settings_are_one_line(tmp_path, keys, line):
    c = tiny.llama(vocab_size=256)
    (tmp_path / "file").write_text("")
    for key, value in keys.items():
        if isinstance(value, str):
            value = value.replace("WORKDIR", str(tmp_path / "run")).replace("FILE", str(tmp_path / "file"))
        c.checkpoint[key] = value
    with pytest.raises(ConfigError) as error:
        check_run(c, str(tmp_path / "run"), 1, "cpu")
    (message,) = [m for m in str(error.value).splitlines() if "local" in m]
    assert line in message
    assert not (tmp_path / "run").exists()
