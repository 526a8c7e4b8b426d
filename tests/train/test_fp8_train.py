"""FP8 training through the config and the loop (`train.fp8`, `jaxpar.fp8`).

- bad keys: an unknown recipe, a history length < 1, a matmul FP8 may not run (the LM head) are
  refused by preflight in one line naming the key;
- the delayed recipe's amax histories are model state (`jaxpar.models.fp8_state`): after a step
  row 0 holds the step's amaxes, which are those of the tensors (checked against the weights
  themselves: the weight amax of q is max |q|), and the optimizer never moves them;
- resume with delayed scaling: stopped after step 2 and resumed, the 4 metrics lines are bitwise
  those of the uninterrupted run (the histories ride in the checkpoint with the params); the run
  then samples and exports to transformers, which hold no histories.
"""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from jaxpar.train.loop import train
from jaxpar.train.observe import TIMING_FIELDS
from jaxpar.train.preflight import ConfigError, check
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.paths import REPO
from tests.support.reference import synthetic_batches


@pytest.mark.parametrize("key, value, named", [
    ("fp8", "fp4", "train.fp8='fp4' is not one of"),
    ("fp8_amax_history", 0, "train.fp8_amax_history=0 must be >= 1"),
    ("fp8_matmuls", "q_proj,lm_head", "train.fp8_matmuls='q_proj,lm_head' names ['lm_head']"),
])
def test_bad_fp8_keys_are_refused_naming_the_key(key, value, named):
    config = tiny.llama({"fp8": "delayed", key: value})
    with pytest.raises(ConfigError) as error:
        check(config, 1)
    assert named in str(error.value)


def test_per_replica_accumulation_is_refused_and_zero3_is_not():
    """data 2 with accumulation 2 runs each replica's microbatches under a vmap, where an amax is the
    replica's own, not the step's: refused in one line naming the ways out; ZeRO-3 takes another path."""
    config = tiny.with_overrides(tiny.llama({"fp8": "tensorwise", "grad_accum": 2}, vocab_size=256), {"data": 2})
    with pytest.raises(ConfigError) as error:
        check(config, 2)
    assert str(error.value) == ("train.fp8='tensorwise' with mesh.data=2 and train.grad_accum=2 is not supported yet (each "
                                "data replica would take its own amax); use parallel.zero_stage=3 or train.grad_accum=1")
    config.parallel.zero_stage = 3
    check(config, 2)


def test_delayed_histories_hold_the_step_amaxes():
    config = tiny.llama({"fp8": "delayed", "fp8_amax_history": 3})
    program = build(config, jax.devices()[:1])
    state = program.init()
    weights = []  # q before each step (the step donates its state: fetched first)
    for batch in synthetic_batches(config, 2):
        weights.append(np.asarray(jax.device_get(state.params["layers"]["attention"]["q"])))
        state, _ = program.step(state, jax.device_put(batch, program.batch_sharding))
    history = np.asarray(jax.device_get(state.params)["layers"]["attention"]["fp8_history"])
    assert history.shape == (2, 4, 4, 3)  # [L, (q, k, v, o), H + 1, (x, w, dy)]
    # Row 0: step 2's amaxes, row 1: step 1's; the weight amax of q is that of the q the step ran with.
    for row, q in zip((1, 0), weights):
        np.testing.assert_allclose(history[:, 0, row, 1], np.max(np.abs(q), axis=(1, 2, 3)), rtol=1e-6)
    assert np.all(history[:, :, :2] > 0) and not np.any(history[:, :, 2:]), "two steps: two rows, the rest empty"


def _script_main(name: str, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records if "goodput" not in r]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_with_delayed_scaling_is_bitwise_identical(tmp_path):
    def config(steps):
        return tiny.with_overrides(
            tiny.llama(vocab_size=256), {"data": -1},
            train={"steps": steps, "fp8": "delayed", "fp8_amax_history": 2, "final_learning_rate_fraction": 1.0},
            checkpoint={"every_steps": 2},
        )

    train(config(4), str(tmp_path / "reference"), progress=False)
    train(config(2), str(tmp_path / "run"), progress=False)
    history = train(config(4), str(tmp_path / "run"), progress=False)
    assert [r["step"] for r in history] == [3, 4]
    assert _metrics(tmp_path / "run") == _metrics(tmp_path / "reference"), "resumed losses differ from the uninterrupted run"
    # The histories steer training only: sampling and a transformers export read the run without them.
    assert _script_main("sample", [f"--workdir={tmp_path / 'run'}", "--prompt=def ", "--max_new_tokens=2"]) == 0
    assert _script_main("convert", [f"--from_checkpoint={tmp_path / 'run'}", f"--to_hf={tmp_path / 'hf'}"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
