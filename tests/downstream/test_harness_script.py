"""scripts/harness.py end to end (in process) and the harness the training loop calls.

`run` on a transformers folder writes lm-eval's results; `lm_eval` is lm-eval's own command line
with `--model jaxpar`; bad input is one line, exit 2, before the model is loaded. In the loop
(`jaxpar.downstream.harness.run_harness`) the params of a training mesh (data 4 x tensor 2, ZeRO-3)
give the record one device gives, and the global random generators training may use are left as
they were.
"""

import importlib.util
import json
import os
import random

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from jaxpar.downstream import harness  # noqa: E402
from jaxpar.train.setup import build  # noqa: E402
from tests.downstream.local_tasks import MC, hf_checkpoint, write_tasks  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.scripts import run_script  # noqa: E402

pytestmark = pytest.mark.slow

spec = importlib.util.spec_from_file_location("harness_script", os.path.join(ROOT, "scripts", "harness.py"))
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness_script")
    return hf_checkpoint(root / "model"), write_tasks(root / "tasks")


def run(capsys, *argv):
    code = script.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_writes_lm_evals_results(setup, capsys, tmp_path):
    model, tasks = setup
    output = tmp_path / "results.json"
    code, out, err = run(capsys, "run", f"--from_hf={model}", f"--tasks={MC}", f"--include_path={tasks}", "--limit=4",
                         f"--output={output}", "--log_samples", "--tensor=2")
    assert code == 0, err
    assert "on mesh data=4" in out and "tensor=2" in out and "|acc" in out.replace(" ", "")
    results = json.loads(output.read_text())
    assert set(results["results"][MC]) >= {"acc,none", "acc_norm,none"} and len(results["samples"][MC]) == 4


def test_lm_evals_command_line_with_model_jaxpar(setup):
    model, tasks = setup
    done = run_script("harness.py", "lm_eval", "--", "--model", "jaxpar", "--model_args", f"from_hf={model},tensor=1",
                      "--batch_size", "4", "--tasks", MC, "--include_path", tasks, "--limit", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jaxpar ({'from_hf'" in done.stdout or "jaxpar (from_hf=" in done.stdout, done.stdout
    assert MC in done.stdout and "acc" in done.stdout


@pytest.mark.parametrize("flags, message", [
    (("--tasks=nope",), "error: --tasks: 'nope' is not an lm-eval task in {tasks} or lm-eval's own"),
    (("--tasks=a", "--include_path=/no/such"), "error: --include_path=/no/such is not a folder (of lm-eval task YAML files)"),
    (("--tasks=a", "--workdir=/x"), "error: give exactly one of --workdir, --checkpoint, --from_hf (got --workdir, --from_hf)"),
])
def test_bad_input_is_one_line_exit_2(setup, capsys, flags, message):
    model, tasks = setup
    extra = () if any(f.startswith("--include_path") for f in flags) else (f"--include_path={tasks}",)
    code, out, err = run(capsys, "run", f"--from_hf={model}", *flags, *extra)
    assert code == 2 and err.strip() == message.format(tasks=tasks), err
    assert "evaluating" not in out


def test_in_the_loop_the_training_mesh_gives_the_one_device_record(tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    config = tiny.llama(vocab_size=256)  # a byte-corpus run: its tokenizer is bytes
    config.mesh.update(data=4, tensor=2)
    config.parallel.zero_stage = 3
    config.eval.update(harness_every_steps=10, harness_tasks=MC, harness_include_path=tasks, harness_limit=6)
    assert harness.checks(config) == [] and harness.task_problems(config) == []
    program = build(config, jax.devices())
    params = program.init().params
    random.seed(1)
    np.random.seed(1)
    python, numpy = random.getstate(), np.random.get_state()
    record = harness.run_harness(config, params, 10, jax.devices())
    assert random.getstate() == python and np.all(np.random.get_state()[1] == numpy[1]), "training's generators untouched"
    assert set(record) == {"step", f"harness/{MC}/acc", f"harness/{MC}/acc_norm"} and record["step"] == 10
    one_device = harness.Harness(config, jax.devices()[:1])
    assert len(one_device.loaded.sampler.mesh.devices.flat) == 1
    assert one_device.run(jax.tree.map(np.asarray, params), 10) == record
