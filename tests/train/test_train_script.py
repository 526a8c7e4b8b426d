"""The main command end to end: scripts/train.py writes config.json and a metrics.jsonl line per step."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.compile_flags import subprocess_environment
from tests.support.paths import ROOT


def imported(stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported (its stderr lines `import time: ... | name`)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_train_script_on_emulated_devices(tmp_path):
    workdir = tmp_path / "run"
    cmd = [
        sys.executable, "-X", "importtime", os.path.join(ROOT, "scripts", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'llama_tiny.py')}", f"--workdir={workdir}",
        "--cpu_devices=4", "--config.mesh.data=2", "--config.mesh.tensor=2",
        "--config.train.steps=4", "--config.train.seq_len=32", "--config.data.max_corpus_bytes=200000",
        "--config.parallel.zero_stage=1", "--config.train.compute_dtype=bfloat16",
    ]
    env = subprocess_environment(PYTHONPATH=ROOT)  # this checkout's jaxpar, not an installed one
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh: data=2 pipeline=1 context=1 expert=1 tensor=2 on 4 cpu devices" in done.stdout
    assert "per device: params" in done.stdout and "optimizer state" in done.stdout
    # stdout is a pipe, not a terminal: plain lines every train.log_every steps, no progress-bar redraws.
    assert "\r" not in done.stdout and [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")] == [
        "1/4", "2/4", "3/4", "4/4"
    ]
    assert "jax 0." in done.stdout and "mesh axes across processes: none" in done.stdout
    # Without --plan, the planner and the cost model behind it are never imported (the --plan
    # test below is the positive control: there the reader sees jaxpar.analysis.planner).
    modules = imported(done.stderr)
    assert "jaxpar.train.loop" in modules and not {m for m in modules if m.startswith("jaxpar.analysis")}
    config = json.loads((workdir / "config.json").read_text())
    assert config["train"]["steps"] == 4 and config["mesh"]["tensor"] == 2
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert "goodput" in lines[-1], "the run's goodput ends metrics.jsonl"
    lines = lines[:-1]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert {"loss", "grad_norm", "learning_rate", "tokens_per_sec"} <= set(m)
        assert m["tokens_per_sec"] > 0


def test_train_script_rejects_bad_config_before_compiling(tmp_path):
    cmd = [
        sys.executable, os.path.join(ROOT, "scripts", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'llama_tiny.py')}", f"--workdir={tmp_path}",
        "--cpu_devices=4", "--config.mesh.data=1", "--config.mesh.tensor=3",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2
    assert done.stderr.startswith("error: mesh") and len(done.stderr.splitlines()) == 1, done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_train_script_takes_the_planners_layout(tmp_path):
    """--plan fills the layout keys the planner picks for the visible devices (printed with the
    reason and the predicted step time, which metrics.jsonl then carries beside the measured one)
    before preflight; a key given on the command line wins over the plan."""
    from jaxpar.analysis.planner import best_layout
    from jaxpar.command.config_file import load_config

    workdir = tmp_path / "run"
    cmd = [
        sys.executable, os.path.join(ROOT, "scripts", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'llama_tiny.py')}", f"--workdir={workdir}",
        "--cpu_devices=4", "--plan=a100-80g", "--config.mesh.tensor=2", "--config.train.steps=1",
        "--config.data.max_corpus_bytes=100000",
    ]
    env = subprocess_environment(PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-X", "importtime", *cmd[1:]], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jaxpar.analysis.planner" in imported(done.stderr)
    config = load_config(os.path.join(ROOT, "configs", "llama_tiny.py"))
    config.mesh.tensor = 2
    config.data.max_corpus_bytes = 100000
    keys, _ = best_layout(config, "a100-80g", 4, fixed={"mesh.tensor"})
    assert "mesh.tensor" not in keys and keys  # the explicit key is not the planner's to set
    line = next(line for line in done.stdout.splitlines() if line.startswith("plan for 4 x a100-80g: "))
    assert all(f"--config.{k}={v}" in line for k, v in keys.items()), line
    written = json.loads((workdir / "config.json").read_text())
    for key, value in keys.items():
        section, name = key.split(".")
        assert written[section][name] == value, key
    assert written["mesh"]["tensor"] == 2
    # The prediction the run is measured against: printed, and logged beside the measured step time.
    from jaxpar.analysis.planner import best_plan

    predicted = best_plan(config, "a100-80g", 4, fixed={"mesh.tensor"}).best.estimate.time.seconds
    assert any(line.startswith(f"predicted for 4 x a100-80g: step_s {predicted:.4g}") for line in done.stdout.splitlines())
    record = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["predicted_step_s"] == written["train"]["predicted_step_s"] == predicted and record["step_s"] > 0

    bad = subprocess.run(cmd[:-4] + ["--plan=b200x"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown hardware 'b200x'"), bad.stderr


NONFINITE_CONFIG = """
from tests.support import tiny
from tests.support.paths import ROOT
def get_config():
    # learning_rate 1e6: step 2's update blows the weights up, step 3's gradient norm is NaN
    # (tests/train/test_nonfinite.py); checkpoints after steps 1 and 2.
    c = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 8}, data={"max_corpus_bytes": 100_000})
    c.train.update(steps=4, learning_rate=1e6)
    c.checkpoint.every_steps = 1
    return c
"""


@pytest.mark.slow
def test_train_script_exit_codes_for_nonfinite_values_and_unreadable_checkpoints(tmp_path, capsys):
    """Exit 3 (stopped for non-finite values, one line), then exit 1 (no readable checkpoint to
    resume from, one line), in process through `main` as the command line runs it."""
    import glob
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", os.path.join(ROOT, "scripts", "train.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = tmp_path / "config.py"
    config.write_text(NONFINITE_CONFIG)
    workdir = tmp_path / "run"
    args = [f"--config={config}", f"--workdir={workdir}"]
    assert script.main(args) == script.EXIT_NONFINITE == 3
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: step 3: non-finite"), line
    checkpoints = workdir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["1", "2"], "the non-finite step is never saved"
    for step in ("1", "2"):  # damage both: nothing is left to resume from
        victim = max(glob.glob(str(checkpoints / step / "state" / "**" / "d" / "*"), recursive=True), key=os.path.getsize)
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    assert script.main(args) == script.EXIT_CHECKPOINT == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "checkpoint" in line, line
