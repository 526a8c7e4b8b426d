"""Faults of a real training process (scripts/train.py in a subprocess):

- kill -9 while an async checkpoint is being written: the next start resumes from the last complete
  checkpoint, reports and removes the incomplete one, and metrics.jsonl continues with every step
  exactly once;
- SIGTERM / SIGINT (preemption, Ctrl-C): the step finishes, a final checkpoint is written, one line
  says so, and the exit code is 143 / 130.
(A damaged checkpoint is in tests/test_resume.py, a non-finite stop in tests/test_nonfinite.py.)
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.checkpoint.listing import finished_steps, incomplete_saves
from tests.test_bad_inputs import write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
WORKER = os.path.join(ROOT, "tests", "train_worker.py")

# vocab 8192 makes each checkpoint ~13 MB, so a save is still being written when killed (the worker
# exits 5 instead of killing if it was not).
CONFIG_FILE = """
from tests import tiny
def get_config():
    c = tiny.with_overrides(tiny.llama(vocab_size={vocab}), {{"data": 2, "tensor": 2}}, data={{"max_corpus_bytes": 100_000}})
    c.train.steps = {steps}
    c.checkpoint.every_steps = {every}
    return c
"""


def env():
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environment["PYTHONPATH"] = ROOT
    return environment


def lines(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(300)
def test_kill_9_during_an_async_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    config = write(tmp_path / "config.py", CONFIG_FILE.format(vocab=8192, steps=3, every=1))
    workdir = tmp_path / "run"
    args = [f"--config={config}", f"--workdir={workdir}", "--cpu_devices=4"]
    killed = subprocess.run(
        [sys.executable, WORKER, "kill_mid_save", "2", "--", *args], capture_output=True, text=True, env=env(), timeout=200
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]
    checkpoints = str(workdir / "checkpoints")
    (pending,) = incomplete_saves(checkpoints)
    assert finished_steps(checkpoints) == [1] and os.path.basename(pending).startswith("2.orbax-checkpoint-tmp")
    assert [r["step"] for r in lines(workdir)] == [1, 2]

    resumed = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env(), timeout=200)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"ignored incomplete checkpoint {pending}" in output
    assert f"resumed from checkpoint {checkpoints}/1 (step 1)" in output
    assert [r["step"] for r in lines(workdir)] == [1, 2, 3], "every step exactly once"
    assert finished_steps(checkpoints) == [1, 2, 3] and incomplete_saves(checkpoints) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_a_final_checkpoint_and_exits_cleanly(tmp_path, signum):
    config = write(tmp_path / "config.py", CONFIG_FILE.format(vocab=256, steps=1000, every=0))
    workdir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, SCRIPT, f"--config={config}", f"--workdir={workdir}", "--cpu_devices=4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 200
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.2)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in out + err
    done = len(lines(workdir))
    checkpoints = str(workdir / "checkpoints")
    assert finished_steps(checkpoints) == [done], "the final checkpoint is the last step run"
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1] == (
        f"interrupted by {name} after step {done}: checkpoint {checkpoints}/{done} saved; rerun the same command to resume"
    )
    assert f"received {name}: finishing this step and saving a checkpoint" in out
    assert (workdir / ".lock").read_text() == "", "the lock was not released"


@pytest.mark.timeout(300)
def test_a_checkpoint_write_that_fails_is_one_line(tmp_path):
    """No file may grow past 64 KiB (RLIMIT_FSIZE), so the first checkpoint's array files fail to
    write in Orbax's background threads, as on a disk that fills during the save: one line naming
    the directory, step and OS error, exit 1, and none of Orbax's own reports of it."""
    config = write(tmp_path / "config.py", CONFIG_FILE.format(vocab=256, steps=2, every=1))
    workdir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, WORKER, "limit_file_size", str(64 << 10), "--", f"--config={config}", f"--workdir={workdir}", "--cpu_devices=4"],
        capture_output=True, text=True, env=env(), timeout=200,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: writing checkpoints in {workdir / 'checkpoints'} failed at step 1") and "File too large" in line
    assert finished_steps(str(workdir / "checkpoints")) == []
