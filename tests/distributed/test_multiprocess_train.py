"""scripts/train.py as 2 processes x 4 CPU devices (scripts/launch_local.py), checkpointing into a
shared directory, then resumed by 1 process x 8 devices: the losses continue as the single-process
run's would. Reference: the uninterrupted single-process run of the same config (constant learning
rate, so stopping at step 3 by `train.steps` changes nothing else). Also checked: only process 0
logs and writes metrics.jsonl, and every process wrote its own shards of the checkpoint."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxpar.train.loop import train
from tests.support import tiny
from tests.support.compile_flags import subprocess_environment
from tests.support.files import write
from tests.support.paths import ROOT
from tests.support.processes import free_port

pytestmark = pytest.mark.multiprocess  # every test here starts several JAX processes of one run

LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
SCRIPT = os.path.join(ROOT, "scripts", "train.py")

CONFIG_FILE = """
from tests.support import tiny
def get_config():
    return tiny.with_overrides(
        tiny.llama(vocab_size=256), {"data": 2, "tensor": 4}, data={"max_corpus_bytes": 100_000},
        train={"steps": 6, "final_learning_rate_fraction": 1.0}, checkpoint={"every_steps": 2},
    )
"""


def config():
    return tiny.with_overrides(
        tiny.llama(vocab_size=256), {"data": 2, "tensor": 4}, data={"max_corpus_bytes": 100_000},
        train={"steps": 6, "final_learning_rate_fraction": 1.0}, checkpoint={"every_steps": 2},
    )


def losses(workdir):
    """metrics.jsonl's step records (each start's goodput record left out)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "goodput" not in r]


@pytest.mark.timeout(300)
def test_two_processes_train_and_checkpoint_one_process_resumes(tmp_path):
    workdir = tmp_path / "run"
    config_file = write(tmp_path / "config.py", CONFIG_FILE)
    env = subprocess_environment(PYTHONPATH=ROOT)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, LAUNCH, "--processes=2", "--devices_per_process=4", "--",
         sys.executable, SCRIPT, f"--config={config_file}", f"--workdir={workdir}", "--config.train.steps=3"],
        capture_output=True, text=True, env=env, timeout=280,
    )
    print(f"2 processes x 4 devices, 3 steps with checkpoints: {time.perf_counter() - start:.1f}s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert any(line.startswith("[0] step 3/3") for line in out), done.stdout[-3000:]
    assert not any(line.startswith("[1] step") or line.startswith("[1] mesh") for line in out), "process 1 logged"
    assert any(line.startswith("[0] mesh axes across processes: data") for line in out), done.stdout[-3000:]
    assert [r["step"] for r in losses(workdir)] == [1, 2, 3], "metrics written once, by process 0"
    step3 = workdir / "checkpoints" / "3" / "state"
    assert sorted(d for d in os.listdir(step3) if d.startswith("ocdbt.process_")) == ["ocdbt.process_0", "ocdbt.process_1"]

    history = train(config(), str(workdir), progress=False)  # this process: 1 x 8 devices, same mesh
    assert [r["step"] for r in history] == [4, 5, 6]
    train(config(), str(tmp_path / "reference"), progress=False)
    got, want = losses(workdir), losses(tmp_path / "reference")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm"):
        a, b = np.array([r[key] for r in got]), np.array([r[key] for r in want])
        error = float(np.max(np.abs(a - b) / np.abs(b)))
        print(f"{key}: 2-process run + 1-process resume vs 1-process run, max relative error {error:.2e}")
        assert error <= 1e-5, (key, a, b)


LOST_CONFIG = """
from tests.support import tiny
def get_config():
    return tiny.with_overrides(
        tiny.llama(vocab_size=256), {"data": 2, "tensor": 4}, data={"max_corpus_bytes": 100_000},
        train={"steps": 100_000}, checkpoint={"every_steps": 2, "keep": 0},
    )
"""


@pytest.mark.timeout(400)
def test_a_lost_process_ends_the_other_with_one_line(tmp_path):
    """Two processes started as a scheduler starts them (one command each, the JAX_* variables);
    process 1 is killed with SIGKILL once a checkpoint is complete. Process 0 must end by itself,
    within the subprocess timeout, with exit code 4 and one line naming process 1 — not a Gloo
    traceback and JAX's abort — and the last complete checkpoint must restore."""
    from jaxpar.checkpoint import Checkpoints, abstract_state
    from jaxpar.checkpoint.listing import finished_steps
    from jaxpar.command.config_file import load_config
    from jaxpar.peers import EXIT_PEER_LOST
    from jaxpar.train.setup import build

    config_file = write(tmp_path / "config.py", LOST_CONFIG)
    workdir, checkpoints = tmp_path / "run", str(tmp_path / "run" / "checkpoints")
    env = {k: v for k, v in subprocess_environment().items() if k != "JAX_PLATFORMS"}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4", JAX_NUM_PROCESSES="2",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", PYTHONUNBUFFERED="1")
    logs = [(open(tmp_path / f"out{i}", "w"), open(tmp_path / f"err{i}", "w")) for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, SCRIPT, f"--config={config_file}", f"--workdir={workdir}"],
                         env=dict(env, JAX_PROCESS_ID=str(i)), stdout=out, stderr=err)
        for i, (out, err) in enumerate(logs)
    ]
    try:
        deadline = time.monotonic() + 300
        while not finished_steps(checkpoints):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, (tmp_path / "err0").read_text()[-3000:]
            time.sleep(0.2)
        procs[1].kill()
        procs[1].wait()
        procs[0].wait(timeout=60)  # the bound: JAX alone takes its heartbeat timeout, then aborts
    finally:
        for p in procs:
            p.kill()
        for out, err in logs:
            out.close()
            err.close()
    err = (tmp_path / "err0").read_text()
    assert procs[0].returncode == EXIT_PEER_LOST, err[-3000:]
    assert "Traceback" not in err and "Check failure" not in err and "Terminating process" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: process 1 of 2 is lost (its liveness port 127.0.0.1:") and "the process died or was killed" in line
    steps = finished_steps(checkpoints)
    assert f"the newest complete checkpoint, {checkpoints}/" in line and f"stopping process 0 too (exit {EXIT_PEER_LOST})" in line
    program = build(load_config(config_file))
    with Checkpoints(checkpoints, every_steps=0, read_only=True) as saved:
        restored = saved.restore(None, abstract_state(jax.eval_shape(program.init), program.state_shardings))
    assert restored.step == steps[-1] and restored.notes == ()
