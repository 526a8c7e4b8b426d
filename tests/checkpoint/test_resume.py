"""Resume through the training loop: the uninterrupted run is the reference.

- same mesh: interrupted after step 3 and resumed, the 6 metrics lines are bitwise those of the
  uninterrupted run (fp32, CPU), and the junk a crash left after the checkpoint in metrics.jsonl
  is dropped (no duplicated or missing steps);
- another mesh (data 2 x tensor 4 -> data 2 x tensor 2 x pipeline 2, and one device): restored onto
  the new shardings, the run continues within 1e-4 of the reference; on one device the newest
  checkpoint is damaged first, so the run names it, falls back to the previous one and redoes a step;
- ZeRO-1 state saved split over data restores split over data x context (`parallel.zero_axes`);
- an incompatible model or data config, or the same data config over a corpus that changed, is
  refused in one line naming the keys; `overwrite=True` replaces the earlier run instead;
- another optimizer, or other values of its own hyperparameters, are refused in one line naming
  both; another learning rate, schedule or length resumes (with a note).
The corpus is a `tokens` file (with its sidecar, no offsets: windows of seq_len + 1 tokens, each
a document filling a row), so the saved data position is the packer's over those windows.
The learning rate is constant (final fraction 1), so stopping a run at step 3 by `train.steps=3`
changes nothing else; one run with warmup + cosine is instead stopped mid-way by SIGTERM (the
schedule then depends on the step the run resumes at) and must still resume bitwise.
"""

import glob
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from jaxpar.data.corpus import corpus_fingerprint
from jaxpar.train import workdir as workdirs
from jaxpar.train.loop import train
from jaxpar.train.observe import TIMING_FIELDS
from jaxpar.train.preflight import ConfigError, check_run
from jaxpar.train.signals import Interrupted
from tests.support import tiny

# Slow: every test here resumes the runs of one module fixture (two trainings); fast checkpoint tests
# are in tests/checkpoint/test_checkpoint.py.
pytestmark = pytest.mark.slow

MESH = {"data": 2, "tensor": 4}


def write_tokens(path, count: int = 20_000) -> str:
    ids = np.random.default_rng(0).integers(0, 256, count).astype(np.uint16)
    ids.tofile(path)
    with open(str(path) + ".json", "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": 256, "num_tokens": count}, f)
    return str(path)


TOKENS = {}  # the module's token file, written by the `runs` fixture


def config(steps: int = 6, mesh=MESH, **train_overrides):
    return tiny.with_overrides(
        tiny.llama(vocab_size=256),
        mesh,
        data={"source": "tokens", "path": TOKENS["path"], "token_dtype": "uint16"},
        train={"steps": steps, "final_learning_rate_fraction": 1.0, **train_overrides},
        checkpoint={"every_steps": 2},
    )


def metrics(workdir) -> list[dict]:
    # Strict JSON: a NaN token would raise here.
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line, parse_constant=reject) for line in f]
    return [r for r in records if "goodput" not in r]  # each start's goodput record left out


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted reference, and a run stopped after step 3 (checkpoints 2 and 3)."""
    root = tmp_path_factory.mktemp("resume")
    TOKENS["path"] = write_tokens(root / "corpus.bin")
    train(config(), str(root / "reference"), progress=False)
    train(config(steps=3), str(root / "stopped"), progress=False)
    return root


@pytest.mark.timeout(300)
def test_resume_on_the_same_mesh_is_bitwise_identical(runs, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(runs / "stopped", workdir)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]
    # What a crash after the last checkpoint leaves: lines past step 3, one cut short.
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n" + '{"step": 5, "lo')
    history = train(config(), str(workdir), progress=False)
    assert [r["step"] for r in history] == [4, 5, 6]
    reference, resumed = metrics(runs / "reference"), metrics(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert without_timing(resumed) == without_timing(reference), "resumed losses differ from the uninterrupted run"
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "4", "6"]  # every 2 steps, the newest 3 kept


def signal_at_step(monkeypatch, step: int, signum=signal.SIGTERM):
    """The process sends itself `signum` while the run is inside step `step`'s bookkeeping, as a
    preemption would during that step: the handler records it, the loop stops after the step."""
    from jaxpar.train.nonfinite import NonFiniteGuard

    observe = NonFiniteGuard.observe

    def signalled(self, at, metrics):
        if at == step:
            os.kill(os.getpid(), signum)
        return observe(self, at, metrics)

    monkeypatch.setattr(NonFiniteGuard, "observe", signalled)


@pytest.mark.timeout(300)
def test_resume_after_sigterm_with_warmup_and_cosine_is_bitwise_identical(runs, tmp_path, monkeypatch):
    """Warmup 2 then cosine to 0.1 over 6 steps, stopped by SIGTERM during step 3 (checkpoints every
    2 steps: only the final one, written on the signal, holds step 3), resumed from that final
    checkpoint: every metrics line, the learning rate included, bitwise the uninterrupted run's."""
    schedule = {"final_learning_rate_fraction": 0.1, "warmup_steps": 2}
    reference = train(config(**schedule), str(tmp_path / "reference"), progress=False)
    assert len({r["learning_rate"] for r in reference}) == 6, "the schedule must change the rate every step"
    workdir = tmp_path / "run"
    with monkeypatch.context() as patch:
        signal_at_step(patch, 3)
        with pytest.raises(Interrupted) as error:
            train(config(**schedule), str(workdir), progress=False)
    checkpoints = workdir / "checkpoints"
    assert str(error.value) == (f"interrupted by SIGTERM after step 3: checkpoint {checkpoints / '3'} saved; "
                                "rerun the same command to resume")
    assert sorted(os.listdir(checkpoints)) == ["2", "3"]
    history = train(config(**schedule), str(workdir), progress=False)
    assert [r["step"] for r in history] == [4, 5, 6]
    assert without_timing(metrics(workdir)) == without_timing(metrics(tmp_path / "reference"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh, devices", [({"data": 2, "tensor": 2, "pipeline": 2}, 8), ({}, 1)], ids=["dp2_tp2_pp2", "one_device"])
def test_resume_onto_another_mesh(runs, tmp_path, mesh, devices, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(runs / "stopped", workdir)
    damaged = devices == 1
    if damaged:  # truncate the largest data file of the newest checkpoint: the run must fall back to step 2
        files = [f for f in glob.glob(str(workdir / "checkpoints" / "3" / "state" / "**" / "d" / "*"), recursive=True)]
        victim = max(files, key=os.path.getsize)
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    history = train(config(mesh=mesh), str(workdir), devices=jax.devices()[:devices], progress=False)
    out = capsys.readouterr()
    restored_step = 2 if damaged else 3
    assert f"resumed from checkpoint {workdir / 'checkpoints' / str(restored_step)}" in out.out
    if damaged:
        assert os.path.isdir(workdir / "checkpoints" / "3.unreadable")
    reference = metrics(runs / "reference")
    resumed = metrics(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert without_timing(resumed[:restored_step]) == without_timing(reference[:restored_step]), (
        "lines before the checkpoint must stay as they were")
    assert [r["step"] for r in history] == list(range(restored_step + 1, 7))
    got = np.array([r["loss"] for r in history])
    want = np.array([r["loss"] for r in reference[restored_step:]])
    error = float(np.max(np.abs(got - want) / np.abs(want)))
    print(f"resume onto {mesh or 'one device'}: max relative loss error {error:.2e} over steps {restored_step + 1}..6")
    assert error <= 1e-4
    np.testing.assert_allclose([r["grad_norm"] for r in history], [r["grad_norm"] for r in reference[restored_step:]], rtol=1e-4)


@pytest.mark.timeout(600)
def test_resume_across_the_zero_axes_change(runs, tmp_path):
    """ZeRO-1 state saved split over data alone (data 4 x context 2, `parallel.zero_axes="data"`)
    restores split over data x context (the default) and trains on as the uninterrupted run does."""
    def zero1(steps, axes):
        c = config(steps=steps, mesh={"data": 4, "context": 2})
        c.parallel.update(zero_stage=1, zero_axes=axes)
        return c

    train(zero1(6, "auto"), str(tmp_path / "reference"), progress=False)
    workdir = str(tmp_path / "run")
    train(zero1(3, "data"), workdir, progress=False)
    history = train(zero1(6, "auto"), workdir, progress=False)
    reference = metrics(tmp_path / "reference")
    assert [r["step"] for r in history] == [4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in history], [r["loss"] for r in reference[3:]], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in history], [r["grad_norm"] for r in reference[3:]], rtol=1e-4)
    # Not vacuous: training moved the loss, and the resumed run's first step is the reference's.
    assert abs(reference[5]["loss"] - reference[0]["loss"]) > 1e-3


def test_incompatible_model_or_data_is_refused_in_one_line(runs, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(runs / "stopped", workdir)
    with open(workdir / "checkpoints" / "3" / "data_iterator" / "metadata") as f:
        saved = json.load(f)
    # The data position (the step, where the packer stands in the document stream) and the corpus's identity.
    assert saved["packer"]["stream"]["index"] > 0, saved
    assert {k: v for k, v in saved.items() if k != "packer"} == {
        "step": 3, "corpus_tokens": 20_000, "corpus_fingerprint": corpus_fingerprint(config().data)
    }, saved
    before = {p: open(p, "rb").read() for p in glob.glob(str(workdir / "**" / "*"), recursive=True) if os.path.isfile(p)}
    other = config()
    other.model.hidden_size = 128
    other.data.path = write_tokens(tmp_path / "copy.bin")
    with pytest.raises(ConfigError) as error:
        train(other, str(workdir), progress=False)
    (line,) = str(error.value).splitlines()
    assert "model.hidden_size (saved 64, now 128)" in line and f"data.path (saved {TOKENS['path']!r}, now {other.data.path!r})" in line
    assert "--overwrite" in line
    # The same data config over a corpus that grew: the saved position would mean other tokens.
    corpus = TOKENS["path"]
    for file in (corpus, corpus + ".json"):
        shutil.copy(file, file + ".orig")
    write_tokens(corpus, 30_000)
    try:
        with pytest.raises(ConfigError) as error:
            train(config(), str(workdir), progress=False)
    finally:
        for file in (corpus, corpus + ".json"):
            os.replace(file + ".orig", file)
    (line,) = str(error.value).splitlines()
    assert "saved reading a corpus of 20000 tokens but the corpus now has 30000" in line, line
    # Rewritten at the same size (another seed): the sampled content tells.
    ids = np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint16)
    shutil.copy(corpus, corpus + ".orig")
    ids.tofile(corpus)
    try:
        with pytest.raises(ConfigError) as error:
            train(config(), str(workdir), progress=False)
    finally:
        os.replace(corpus + ".orig", corpus)
    (line,) = str(error.value).splitlines()
    assert "saved reading a corpus of the same size (20000 tokens) but other content" in line, line
    # A resumed run does not read train.init_from_hf: said once, not silently.
    plan = check_run(config(init_from_hf=str(tmp_path)), str(workdir), 8, "cpu").workdir
    assert plan.resume_step == 3
    assert f"train.init_from_hf={tmp_path} is ignored: this run resumes from checkpoint {workdir / 'checkpoints' / '3'}" in plan.notes
    after = {p: open(p, "rb").read() for p in glob.glob(str(workdir / "**" / "*"), recursive=True) if os.path.isfile(p)}
    assert after == before


def test_another_optimizer_is_refused_in_one_line_but_the_learning_rate_may_change(runs, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(runs / "stopped", workdir)
    for overrides, expected in (
        ({"optimizer": "lion"}, "was saved with train.optimizer='adamw' but this run uses train.optimizer='lion'"),
        ({"adamw": {"b1": 0.8}}, "other adamw hyperparameters: train.adamw.b1 (saved 0.9, now 0.8)"),
    ):
        with pytest.raises(ConfigError) as error:
            train(config(**overrides), str(workdir), progress=False)
        (line,) = str(error.value).splitlines()
        assert expected in line and "the learning rate, schedule and its length may change" in line and "--overwrite" in line
    # Learning rate, schedule and length: resumed, with a note.
    plan, problems = workdirs.inspect(config(steps=8, learning_rate=5e-3, lr_schedule="wsd"), str(workdir), overwrite=False)
    assert problems == [] and plan.resume_step == 3
    (note,) = plan.notes
    assert "train.learning_rate (saved 0.01, now 0.005)" in note and "train.lr_schedule (saved 'cosine', now 'wsd')" in note


@pytest.mark.timeout(300)
def test_overwrite_replaces_the_earlier_run(runs, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(runs / "stopped", workdir)
    other = config(steps=2, seed=1)
    other.model.num_hidden_layers = 1
    history = train(other, str(workdir), overwrite=True, progress=False)
    assert [r["step"] for r in history] == [1, 2]
    assert [r["step"] for r in metrics(workdir)] == [1, 2]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    assert json.loads((workdir / "config.json").read_text())["model"]["num_hidden_layers"] == 1


def snapshot(root) -> dict:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        found.update({os.path.join(dirpath, d): "dir" for d in dirnames})
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                found[os.path.join(dirpath, name)] = f.read()
    return found


def fail_at_step(monkeypatch, failing_step: int):
    """The run dies at `failing_step` (as of an out-of-memory error or a bad shard), before its save."""
    from jaxpar.train.nonfinite import NonFiniteGuard

    observe = NonFiniteGuard.observe

    def dying(self, step, metrics):
        if step == failing_step:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: out of memory at step {step}")
        return observe(self, step, metrics)

    monkeypatch.setattr(NonFiniteGuard, "observe", dying)


@pytest.mark.timeout(300)
def test_overwrite_keeps_the_earlier_run_until_the_new_run_has_a_checkpoint(runs, tmp_path, monkeypatch):
    """A new run that dies before its first checkpoint leaves the earlier run exactly as it was."""
    workdir = tmp_path / "run"
    shutil.copytree(runs / "stopped", workdir)
    before = snapshot(workdir)
    other = config(steps=2)
    other.model.num_hidden_layers = 1
    fail_at_step(monkeypatch, 1)
    with pytest.raises(RuntimeError) as error:
        train(other, str(workdir), overwrite=True, progress=False)
    assert str(error.value) == (
        f"RESOURCE_EXHAUSTED: out of memory at step 1; this run wrote no checkpoint, so the earlier run is back in {workdir}"
    )
    assert snapshot(workdir) == before, "the earlier run was not restored byte for byte"


@pytest.mark.timeout(300)
def test_rerunning_a_run_that_wrote_no_checkpoint_starts_afresh(runs, tmp_path, capsys):
    """What a run of the same config leaves when it dies before its first checkpoint (config.json and
    metrics lines, no checkpoint) does not block the rerun; it is let go at the rerun's first
    checkpoint. Another config's leftovers are still refused."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(config(steps=2).to_json_best_effort(indent=2))
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    other = config(steps=2)
    other.model.num_hidden_layers = 1
    with pytest.raises(ConfigError, match="holds an earlier run .* but no complete checkpoint"):
        train(other, str(workdir), progress=False)
    history = train(config(steps=2), str(workdir), progress=False)
    assert [r["step"] for r in history] == [1, 2] and [r["step"] for r in metrics(workdir)] == [1, 2]
    out = capsys.readouterr().out
    assert f"--workdir={workdir} holds a run of this model and data that wrote no checkpoint: starting afresh" in out
    assert "moved the earlier run aside to" in out
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json", "goodput.json", "metrics.jsonl", "tensorboard"], "let go"


@pytest.mark.timeout(600)
def test_checkpoints_hold_the_natural_layer_order_across_an_interleaved_layout(tmp_path):
    """Interleaved 1F1B (pipeline 2, v = 2, 4 layers) keeps its layer stacks, parameters and Adam
    moments, in the schedule's order (0, 2, 1, 3: `parallel/pipeline/order.py`) and checkpoints in
    the natural order: a one-device checkpoint resumes on it, and its own checkpoint resumes on one
    device, both training on as the uninterrupted one-device run does (a moment left in the wrong
    layer's place would change the next updates far beyond 1e-4)."""
    TOKENS.setdefault("path", write_tokens(tmp_path / "corpus.bin"))

    def layered(steps, mesh):
        c = config(steps=steps, mesh=mesh)
        c.model.num_hidden_layers = 4
        if mesh:
            c.parallel.update(pipeline_schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=2)
        return c

    interleaved = {"pipeline": 2}
    train(layered(5, {}), str(tmp_path / "reference"), devices=jax.devices()[:1], progress=False)
    workdir = tmp_path / "run"
    shutil.copytree(tmp_path / "reference", workdir)
    for newer in ("4", "5"):  # resume the one-device run from its step-2 checkpoint
        shutil.rmtree(workdir / "checkpoints" / newer)
    on_pipeline = train(layered(4, interleaved), str(workdir), devices=jax.devices()[:2], progress=False)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    on_one = train(layered(5, {}), str(workdir), devices=jax.devices()[:1], progress=False)
    reference = metrics(tmp_path / "reference")
    assert [r["step"] for r in on_pipeline + on_one] == [3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in on_pipeline + on_one], [r["loss"] for r in reference[2:]], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in on_pipeline + on_one], [r["grad_norm"] for r in reference[2:]], rtol=1e-4)
