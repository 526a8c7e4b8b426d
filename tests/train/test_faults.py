"""Faults of a real training process (scripts/train.py in a subprocess):

- kill -9 while an async checkpoint is being written, a real race: scripts/train.py saves every step
  (30 MB checkpoints take 0.3 - 0.9 s to write here) and the test watches the checkpoint directory,
  SIGKILLing the process as soon as an Orbax temporary folder is there beside two complete checkpoints
  (tried again, from scratch, in the rare case the save completed between the look and the kill).
  The next start resumes from the newest complete checkpoint, reports and removes the incomplete
  one, metrics.jsonl continues with every step exactly once, and every step the killed run logged
  is redone bitwise;
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
    """metrics.jsonl's step records (each start's goodput record left out)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "goodput" not in r]


def complete_lines(workdir) -> list[dict]:
    """metrics.jsonl's step records, leaving out a last line a kill may have cut short."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f.read().splitlines(keepends=True) if line.endswith("\n")]
    return [r for r in records if "goodput" not in r]


def kill_during_a_save(args, workdir, output) -> str | None:
    """Starts scripts/train.py and SIGKILLs it once a save is in flight beside two complete ones (so
    "the newest" is a choice); the incomplete save left behind, or None when the save finished
    between the look and the kill."""
    checkpoints = os.path.join(workdir, "checkpoints")
    with open(output, "w") as out:
        process = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=out, stderr=subprocess.STDOUT, env=env())
    try:
        while process.poll() is None:
            names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
            if sum(n.isdigit() for n in names) >= 2 and any(".orbax-checkpoint-tmp" in n for n in names):
                process.kill()  # SIGKILL
                break
            time.sleep(0.001)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run ended before a save was seen: {open(output).read()[-3000:]}"
    pending = incomplete_saves(checkpoints)
    return pending[0] if pending else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_during_an_async_save_resumes_from_the_newest_complete_checkpoint(tmp_path):
    config = write(tmp_path / "config.py", CONFIG_FILE.format(vocab=32768, steps=10, every=1))
    for attempt in range(5):
        workdir = tmp_path / f"run{attempt}"
        args = [f"--config={config}", f"--workdir={workdir}", "--cpu_devices=4"]
        pending = kill_during_a_save(args, str(workdir), tmp_path / f"killed{attempt}.txt")
        if pending is not None:
            break
    else:
        pytest.fail("five saves in a row completed between the look and the kill")
    checkpoints = str(workdir / "checkpoints")
    (left,) = incomplete_saves(checkpoints)
    newest = finished_steps(checkpoints)[-1]
    in_flight = int(os.path.basename(pending).split(".")[0])
    killed_lines = complete_lines(workdir)
    print(f"attempt {attempt + 1}: killed during the save of step {in_flight}; complete: {finished_steps(checkpoints)}; "
          f"{len(killed_lines)} steps logged")
    # The save of step `in_flight` started once the previous one was complete and its line written.
    assert in_flight == newest + 1 and [r["step"] for r in killed_lines] == list(range(1, len(killed_lines) + 1))
    assert len(killed_lines) >= in_flight

    resumed = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env(), timeout=400)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"ignored incomplete checkpoint {pending}" in output
    assert f"resumed from checkpoint {checkpoints}/{newest} (step {newest})" in output
    assert [r["step"] for r in lines(workdir)] == list(range(1, 11)), "every step exactly once"
    # Every step the killed run logged, those redone from checkpoint `newest` included, is bitwise the same.
    untimed = lambda r: {k: v for k, v in r.items() if k not in TIMING_FIELDS}  # noqa: E731
    assert [untimed(r) for r in lines(workdir)[: len(killed_lines)]] == [untimed(r) for r in killed_lines]
    assert finished_steps(checkpoints)[-1] == 10 and incomplete_saves(checkpoints) == []


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
        # The limit would stop the suite's XLA cache entries too (tests/conftest.py): only the checkpoint may fail.
        capture_output=True, text=True, env={**env(), "JAX_ENABLE_COMPILATION_CACHE": "false"}, timeout=200,
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
