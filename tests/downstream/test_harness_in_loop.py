"""lm-eval tasks in the training loop (`eval.harness_every_steps`), against scripts/harness.py run on
the checkpoints the same run saved: the record of step 2 and of step 4 in metrics.jsonl equals what
lm-eval gives on checkpoint 2 and checkpoint 4 read back from disk, on a pipeline mesh whose
storage layout is not the natural layer order (interleaved stages); the rolling log-likelihood task's
perplexity is the number any other params would move. And the evaluations change no
training number: the losses are bitwise those of the run without them.
"""

import json
import os

import jax
import pytest

pytest.importorskip("lm_eval")

from jaxpar.train.loop import train  # noqa: E402
from jaxpar.train.observe import TIMING_FIELDS  # noqa: E402
from tests.downstream.local_tasks import MC, ROLLING, write_tasks  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.train.probe import script  # noqa: E402

pytestmark = pytest.mark.slow


def config(tasks, harness: bool):
    c = tiny.with_overrides(tiny.llama(vocab_size=256, num_hidden_layers=4), {"pipeline": 2, "data": 2},
                            train={"steps": 4, "peak_flops_per_device": 1e12}, checkpoint={"every_steps": 2, "keep": 0})
    c.parallel.pipeline_schedule, c.parallel.virtual_stages = "interleaved_1f1b", 2
    c.data.max_corpus_bytes = 100_000
    if harness:
        c.eval.update(harness_every_steps=2, harness_tasks=f"{MC},{ROLLING}", harness_include_path=tasks, harness_limit=6)
    return c


def records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_loops_records_equal_lm_eval_on_the_saved_checkpoints(tmp_path, capsys):
    tasks = write_tasks(tmp_path / "tasks")
    devices = jax.devices()[:4]
    train(config(tasks, True), str(tmp_path / "run"), devices=devices, progress=False)
    train(config(tasks, False), str(tmp_path / "plain"), devices=devices, progress=False)
    found = {r["step"]: r for r in records(tmp_path / "run") if any(k.startswith("harness/") for k in r)}
    assert sorted(found) == [2, 4]
    for step in (2, 4):
        capsys.readouterr()
        out_file = tmp_path / f"results{step}.json"
        assert script("harness").main(["run", f"--checkpoint={tmp_path / 'run' / 'checkpoints'}", f"--step={step}",
                                       f"--tasks={MC},{ROLLING}", f"--include_path={tasks}", "--limit=6", f"--output={out_file}"]) == 0
        results = json.loads(out_file.read_text())["results"]
        assert found[step][f"harness/{MC}/acc"] == results[MC]["acc,none"]
        assert found[step][f"harness/{MC}/acc_norm"] == results[MC]["acc_norm,none"]
        # A continuous number: any other params (the storage layer order, another step's) move it.
        assert found[step][f"harness/{ROLLING}/word_perplexity"] == pytest.approx(results[ROLLING]["word_perplexity,none"], rel=1e-6)

    def losses(workdir):
        return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records(workdir) if "loss" in r]

    assert losses(tmp_path / "run") == losses(tmp_path / "plain")
