"""Faults of a real training process (scripts/train.py in a subprocess):

- kill -9 while an async checkpoint is being written: the next start resumes from the last complete
  checkpoint, reports and removes the incomplete one, and metrics.jsonl continues with every step
  exactly once;
- SIGTERM / SIGINT (preemption, Ctrl-C): the step finishes, a final checkpoint is written, one line
  says so, and the exit code is 143 / 130; during start-up (every phase: preflight, data, build,
  compile, restore, the first step) the run stops at the end of the phase with one line, never a
  crash; a second signal quits at once even while the main thread is blocked in native code;
- a checkpoint write that fails in Orbax's background threads: one line, exit 1.
(A damaged checkpoint is in tests/checkpoint/test_resume.py, a non-finite stop in tests/train/test_nonfinite.py.)
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.checkpoint.listing import finished_steps, incomplete_saves
from jaxpar.train.observe import TIMING_FIELDS
from jaxpar.train.signals import StopSignals
from tests.support.compile_flags import subprocess_environment
from tests.support.files import write
from tests.support.paths import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "train.py")
WORKER = os.path.join(ROOT, "tests", "support", "train_worker.py")

# The kill -9 test's worker holds the save's commit back, so the kill lands mid-save however fast
# the storage (it exits 5 if no save was under way).
CONFIG_FILE = """
from tests.support import tiny
def get_config():
    c = tiny.with_overrides(tiny.llama(vocab_size={vocab}), {{"data": 2, "tensor": 2}}, data={{"max_corpus_bytes": 100_000}})
    c.train.steps = {steps}
    c.checkpoint.every_steps = {every}
    return c
"""


def env():
    return subprocess_environment(PYTHONPATH=ROOT)


def lines(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
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
    killed_lines = lines(workdir)
    assert [r["step"] for r in killed_lines] == [1, 2]

    resumed = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env(), timeout=200)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"ignored incomplete checkpoint {pending}" in output
    assert f"resumed from checkpoint {checkpoints}/1 (step 1)" in output
    assert [r["step"] for r in lines(workdir)] == [1, 2, 3], "every step exactly once"
    # Step 2, redone from checkpoint 1 (cosine schedule), is bitwise the step the killed run logged.
    redone = lines(workdir)[1]
    assert ({k: v for k, v in redone.items() if k not in TIMING_FIELDS}
            == {k: v for k, v in killed_lines[1].items() if k not in TIMING_FIELDS})
    assert finished_steps(checkpoints) == [1, 2, 3] and incomplete_saves(checkpoints) == []


@pytest.mark.slow
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
    assert not (workdir / ".lock").exists(), "the lock was not released"


@pytest.mark.slow
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


def test_the_signal_handler_only_records():
    """A signal can arrive while the main thread is inside XLA (a compile, a step): the handler must
    never raise there. It records; the run decides at its next safe point."""
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(3):  # a few bytecodes: the Python-level handler has run by now
            pass
        assert signals.received == signal.SIGTERM
        with signals.deferred():
            assert signals.agreed() == signal.SIGTERM


# (phase, signal): the phases in the order a run meets them; each run starts in the same workdir.
PHASES = [
    ("preflight", signal.SIGTERM), ("data", signal.SIGINT), ("build", signal.SIGTERM), ("compile", signal.SIGINT),
    ("first_step", signal.SIGTERM), ("restore", signal.SIGINT),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_signal_at_every_start_up_phase_stops_with_one_line(tmp_path):
    config = write(tmp_path / "config.py", CONFIG_FILE.format(vocab=256, steps=3, every=0))
    workdir = tmp_path / "run"
    args = [f"--config={config}", f"--workdir={workdir}", "--cpu_devices=4"]
    checkpoints = str(workdir / "checkpoints")
    for phase, signum in PHASES:
        done = subprocess.run(
            [sys.executable, WORKER, f"signal_at_{phase}", str(int(signum)), "--", *args],
            capture_output=True, text=True, env=env(), timeout=200,
        )
        name = signal.Signals(signum).name
        assert done.returncode == 128 + signum, (phase, done.returncode, done.stderr[-3000:])
        assert "Traceback" not in done.stdout + done.stderr, phase
        (line,) = done.stderr.strip().splitlines()
        if phase == "first_step":  # in the loop: the step finishes and is saved
            assert line == f"interrupted by {name} after step 1: checkpoint {checkpoints}/1 saved; rerun the same command to resume"
            assert finished_steps(checkpoints) == [1] and [r["step"] for r in lines(workdir)] == [1]
            continue
        then = "resume" if phase == "restore" else "start"
        said = {"data": "loading data"}.get(phase, phase)
        assert line == (f"interrupted by {name} during start-up ({said}); nothing of an earlier run was changed: "
                        f"rerun the same command to {then}")
        assert f"received {name}: stopping after this start-up phase" in done.stdout
        if phase == "restore":
            assert finished_steps(checkpoints) == [1] and [r["step"] for r in lines(workdir)] == [1]
        else:
            assert not (workdir / "metrics.jsonl").exists() and not (workdir / "config.json").exists()
            assert finished_steps(checkpoints) == []


BLOCKED = """
import os, signal, sys, threading, time
import jax
import jax.numpy as jnp
from jaxpar.train.observe import TIMING_FIELDS
from jaxpar.train.signals import StopSignals

# An even counter never equals 7: a computation that never ends (on CPU it runs on the calling thread).
forever = jax.jit(lambda x: jax.lax.while_loop(lambda c: c != 7, lambda c: c + 2, x)).lower(jnp.uint32(8)).compile()
main = threading.main_thread().ident


def where_main_is():
    frame, chain = sys._current_frames()[main], []
    while frame is not None:
        chain.append(frame.f_code.co_name)
        frame = frame.f_back
    return chain, sys._current_frames()[main].f_lasti


def send_twice():
    # Once the main thread is inside `blocked` and its Python frames no longer move: in native code.
    # (Whenever they arrive, the new handling quits at once; the wait makes an old handler, which
    # can only act between bytecodes, face the case it cannot handle.)
    previous = None
    while True:
        chain, position = where_main_is()
        if "blocked" in chain and (chain, position) == previous:
            break
        previous = (chain, position)
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGINT)
    while signals.received is None:  # two signals pending at once would merge into one
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)


def blocked():
    forever(jnp.uint32(8)).block_until_ready()


with StopSignals() as signals, signals.deferred():
    threading.Thread(target=send_twice, daemon=True).start()
    blocked()
print("the computation ended")
"""


@pytest.mark.timeout(120)
def test_a_second_signal_quits_at_once_even_inside_native_code(tmp_path):
    """The main thread waits on an XLA computation that never ends, where no Python handler can run;
    two Ctrl-C: the process ends with one line and 130, not after the step."""
    script = write(tmp_path / "blocked.py", BLOCKED)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env(), timeout=90)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "the computation ended" not in done.stdout
    assert "received SIGINT: finishing this step and saving a checkpoint (send it again to quit at once)" in done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert line == "interrupted by SIGINT again: quit at once without a final checkpoint; nothing of an earlier run was changed"
