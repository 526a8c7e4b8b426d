"""The probe's lifecycle faults: a checkpoint directory shared by two runs, a run the fit check
refuses, data that fails to read after the preflight (in a training step, in the final evaluation),
a signal during a whole-set evaluation and a sampler reading a run that rotates its checkpoints.
Refusals are one line, exit 2, nothing written (`tests/train/probe.py`); a fault after the run
started is one line, exit 2, after a checkpoint of every step trained, checked against the steps
metrics.jsonl records and against the bad record's place, which the case planted."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.checkpoint.listing import finished_steps, saved_config, saved_data_state
from jaxpar.train import workdir as workdirs
from tests.support.compile_flags import subprocess_environment
from tests.support.paths import ROOT
from tests.support.processes import hold_lock
from tests.train.probe import CONFIG_FILE, Probe, script


@pytest.fixture
def probe(tmp_path, capsys, monkeypatch):
    return Probe(tmp_path, capsys, monkeypatch)


def steps_logged(workdir) -> list[int]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [record["step"] for record in map(json.loads, f) if "loss" in record]


def one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# -- two runs, one checkpoint directory ------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["elsewhere", "another_runs_workdir"])
def test_a_checkpoint_dir_another_live_run_writes_is_refused_naming_it(probe, inside):
    """Run B (its own workdir) names the checkpoint directory live run A writes (a folder of its
    own, or A's workdir/checkpoints): refused in one line naming A's host and pid; nothing written."""
    shared = probe.root / ("a" if inside else "") / "checkpoints"
    holder = hold_lock(shared)  # run A: it holds the directory's lock as a run does
    try:
        probe.refused("train", probe.train(f"--config.checkpoint.dir={shared}"),
                      f"checkpoint.dir={shared} is in use by another run (host elsewhere, pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_checkpoint_dir_lock_is_taken_over_and_released(tmp_path):
    shared = tmp_path / "shared"
    holder = hold_lock(shared)
    holder.kill()  # like kill -9: the lock file keeps its holder's content, nobody holds it
    holder.wait()
    with workdirs.WorkdirLock(str(shared), "checkpoint.dir") as lock:
        assert lock.stale == f"host elsewhere, pid {holder.pid}, since then"
    assert os.listdir(shared) == []


def test_two_runs_never_train_into_one_checkpoint_dir(tmp_path, capsys):
    """The issue's race: the second run resumed from the first's checkpoint and both trained into
    it. Locks are held for the whole run: while one holds the directory, the other's acquire fails."""
    shared = str(tmp_path / "shared")
    first = workdirs.WorkdirLock(shared, "checkpoint.dir").acquire()
    try:
        with pytest.raises(workdirs.WorkdirBusy, match=f"checkpoint.dir={shared} is in use by another run .*pid {os.getpid()}"):
            workdirs.WorkdirLock(shared, "checkpoint.dir").acquire()
    finally:
        first.release()


# -- a run the fit check refuses -------------------------------------------------------------------


def test_a_run_the_fit_check_refuses_leaves_nothing(probe, monkeypatch):
    """It used to leave an empty checkpoints/ (and the workdir holding it); a checkpoint.dir of its
    own is not created either."""
    from jaxpar.train import fit

    monkeypatch.setattr(fit, "available_per_device", lambda devices: (1000, "a test's 1000 bytes"))
    monkeypatch.setattr(script("train"), "fit_advice", lambda config, error: "no advice in this test")
    elsewhere = probe.root / "ckpt"
    probe.refused("train", probe.train(f"--config.checkpoint.dir={elsewhere}"), "the step does not fit 8 cpu devices")
    assert not elsewhere.exists()


# -- data that fails after the preflight -----------------------------------------------------------


def test_a_bad_record_deep_in_a_shard_ends_the_run_in_one_line_after_a_checkpoint(probe, monkeypatch, capsys):
    """The preflight reads the first 5 records of each file here (1000 in a real run); line 100 is
    not JSON. Training (documents in shuffled order) ends in one line naming the file and line, exit
    2, after saving the last step it trained: the checkpoint's step is metrics.jsonl's last, and its
    data position is the one after that many batches, recomputed here from the start (not the
    packer's position inside the batch that failed)."""
    from jaxpar.data import checks

    monkeypatch.setattr(checks, "PREFLIGHT_RECORDS", 5)
    path = probe.records("deep.jsonl", 120, bad={100: b"{cut"})
    code = script("train").main(probe.train("--config.data.source=text", f"--config.data.path={path}",
                                            "--config.train.steps=200", "--config.checkpoint.every_steps=0"))
    line = one_line(capsys)
    assert code == 2 and line.startswith(f"error: data.path: {path} line 100 is not a JSON record ("), line
    logged = steps_logged(probe.workdir)
    checkpoints = os.path.join(probe.workdir, "checkpoints")
    assert logged and finished_steps(checkpoints) == [logged[-1]], (logged, finished_steps(checkpoints))
    assert line.endswith(f"the run stopped after step {logged[-1]}; its state is saved in checkpoint {checkpoints}/{logged[-1]}")
    saved = saved_data_state(checkpoints, logged[-1])
    assert {k: saved[k] for k in ("step", "packer")} == _position_after(checkpoints, logged[-1])


def _position_after(checkpoints: str, steps: int) -> dict:
    """The data position after `steps` batches of the saved run's config, read afresh from the start."""
    from ml_collections import ConfigDict

    from jaxpar.data.batches import DocumentBatches
    from jaxpar.data.corpus import training_stream
    from jaxpar.data.packing import Packer

    config = ConfigDict(saved_config(checkpoints, steps))
    batches = DocumentBatches(Packer(training_stream(config), config.train.global_batch_size, config.train.seq_len + 1), prefetch=False)
    for _ in range(steps):
        next(batches)
    return json.loads(json.dumps(batches.get_state()))  # as JSON holds it (tuples become lists)


def test_a_block_pyarrow_cannot_parse_is_found_by_the_preflight(probe, monkeypatch):
    """A datasets source whose line 100 is not JSON, beyond the 5 records the preflight checks one by
    one here: pyarrow parses the file in blocks, so the preflight's first document already meets it.
    One line naming the file and pyarrow's reason (was an ArrowInvalid traceback, exit 1, after
    config.json, metrics.jsonl and tensorboard/ were written); nothing written."""
    from jaxpar.data import checks

    monkeypatch.setattr(checks, "PREFLIGHT_RECORDS", 5)
    path = probe.records("deep.jsonl", 120, bad={100: b"{cut"})
    probe.refused("train", probe.train("--config.data.source=datasets", f"--config.data.path={path}"),
                  f"data.path: {path} cannot be read after record 0 of epoch 0 (ArrowInvalid: JSON parse error")


def test_the_final_eval_failing_on_data_loses_no_trained_step(probe, monkeypatch, capsys):
    """Training reads the first records of the file (in order, a datasets source); the held-out eval
    reads them all and meets the bad last record after training: the final checkpoint is saved
    before the final eval, the line names the record, exit 2."""
    from jaxpar.data import checks

    monkeypatch.setattr(checks, "PREFLIGHT_RECORDS", 5)
    path = probe.records("tail.jsonl", 400, bad={400: b'{"text": ["a list"]}'})
    code = script("train").main(probe.train("--config.data.source=datasets", f"--config.data.path={path}",
                                            "--config.eval.share=0.3", "--config.checkpoint.every_steps=0"))
    line = one_line(capsys)
    assert code == 2 and "record 400 of epoch 0" in line and "holds a list in field 'text'" in line, line
    assert steps_logged(probe.workdir) == [1, 2] and finished_steps(os.path.join(probe.workdir, "checkpoints")) == [2]


def test_a_final_eval_that_crashes_loses_no_trained_step(probe, monkeypatch):
    """Any failure of the final evaluation (here an error planted in it, not a data error) comes
    after the final checkpoint: the trained state is on disk."""
    from jaxpar.train import eval as evaluation

    def crash(self, params, step, stop=None):
        raise RuntimeError("an evaluation that crashes")

    monkeypatch.setattr(evaluation.Evaluator, "run", crash)
    with pytest.raises(RuntimeError, match="an evaluation that crashes"):
        script("train").main(probe.train("--config.eval.share=0.3", "--config.checkpoint.every_steps=0"))
    assert steps_logged(probe.workdir) == [1, 2] and finished_steps(os.path.join(probe.workdir, "checkpoints")) == [2]


# -- a signal during a whole-set evaluation --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_during_a_whole_set_eval_exits_143_within_a_batch(tmp_path):
    """The eval set takes thousands of batches (eval.steps=0: all of it). SIGTERM once the last
    training step is logged: exit 143 with the final checkpoint saved and one line saying so, the
    eval left after the batch it was in (it used to finish the whole set first: 59 s). The bound is
    on batches, not seconds: the eval writes no record, and the process ends while the eval set has
    most of its batches unread (checked by the line, which names the final evaluation)."""
    eval_path = tmp_path / "eval.jsonl"
    with open(eval_path, "w") as f:
        for i in range(60_000):
            f.write(json.dumps({"text": f"an evaluation document, number {i}, of a set too long to read in one go"}) + "\n")
    config = tmp_path / "config.py"
    config.write_text(CONFIG_FILE)
    workdir = tmp_path / "run"
    env = subprocess_environment(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--config={config}", f"--workdir={workdir}",
                                "--config.data.source=text", f"--config.data.path={ROOT}/README.md", f"--config.eval.path={eval_path}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = workdir / "metrics.jsonl"
    while process.poll() is None and not (metrics.exists() and '"step": 2' in metrics.read_text()):
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=200)
    assert process.returncode == 143, (out[-2000:], err[-2000:])
    assert err.strip().splitlines()[-1] == (f"interrupted by SIGTERM during the final evaluation after step 2: checkpoint "
                                            f"{workdir}/checkpoints/2 saved; rerun the same command to resume"), err[-2000:]
    assert "eval_loss" not in metrics.read_text() and finished_steps(str(workdir / "checkpoints")) == [2]


# -- a sampler reading a run that rotates its checkpoints -----------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from jaxpar.train.loop import train
    from tests.support import tiny

    workdir = tmp_path_factory.mktemp("rotating") / "run"
    config = tiny.llama(vocab_size=256)
    config.data.max_corpus_bytes, config.train.steps, config.checkpoint.every_steps = 100_000, 2, 1
    train(config, str(workdir), progress=False)
    return workdir


def _sample(workdir, capsys, *flags):
    code = script("sample").main([f"--workdir={workdir}", "--prompt_ids=1,2,3", "--max_new_tokens=2", *flags])
    return code, capsys.readouterr()


def test_a_checkpoint_rotated_away_while_read_is_never_called_damaged(two_checkpoints, tmp_path, monkeypatch, capsys):
    """The run deletes step 2 (checkpoint.keep) just as the sampler starts reading it: the sampler
    reads step 1, the newest that still exists, and says so. Before, 1 try in 6 ended in a false
    'checkpoint 2 is unreadable'."""
    from jaxpar.checkpoint import manager

    workdir = tmp_path / "run"
    shutil.copytree(two_checkpoints, workdir)
    restore, deleted = manager.Checkpoints.restore, []

    def rotated_as_read(self, step, target):
        if not deleted:  # the run's rotation, between the sampler's listing and its read
            deleted.append(step)
            shutil.rmtree(os.path.join(self.directory, str(step)))
        return restore(self, step, target)

    monkeypatch.setattr(manager.Checkpoints, "restore", rotated_as_read)
    code, out = _sample(workdir, capsys)
    assert code == 0 and deleted == [2], out.err[-2000:]
    assert "sampling from checkpoint" in out.out and "checkpoints/1 (step 1)" in out.out, out.out[:500]
    # Asked for by --step, a step deleted while read is said so (not called damaged).
    shutil.copytree(two_checkpoints, tmp_path / "again")
    deleted.clear()
    code, out = _sample(tmp_path / "again", capsys, "--step=2")
    assert code == 2 and out.err.splitlines() == [
        f"error: --step=2: checkpoint {tmp_path}/again/checkpoints/2 was deleted while it was read (the run rotates its "
        f"checkpoints: checkpoint.keep); choose a newer --step"], out.err


def test_a_damaged_checkpoint_is_still_reported_as_damaged(two_checkpoints, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(two_checkpoints, workdir)
    shutil.rmtree(workdir / "checkpoints" / "2" / "state")  # damaged, still listed as complete
    code, out = _sample(workdir, capsys)
    assert code == 2 and len(out.err.splitlines()) == 1 and "checkpoints/2 is unreadable" in out.err, out.err
