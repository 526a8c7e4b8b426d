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

import numpy as np
import pytest

from jaxpar.train.loop import train
from tests import tiny
from tests.test_bad_inputs import write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
SCRIPT = os.path.join(ROOT, "scripts", "train.py")

CONFIG_FILE = """
from tests import tiny
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
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(300)
def test_two_processes_train_and_checkpoint_one_process_resumes(tmp_path):
    workdir = tmp_path / "run"
    config_file = write(tmp_path / "config.py", CONFIG_FILE)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
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
