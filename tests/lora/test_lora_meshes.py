"""LoRA on meshes against one device: the same losses, adapter gradients and adapters after three
steps as the one-device LoRA run, the frozen base bitwise as it started, for a dense family under
data 2 ZeRO-3 x tensor 2 (SP), a pipeline, and Mixtral under expert 2; and a run resumed from a
checkpoint, bitwise on the same mesh and alike on another."""

import math

import jax
import numpy as np
import pytest

from jaxpar.models import lora
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.reference import assert_matches_reference, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3
LORA = {"lora": {"rank": 4, "alpha": 8.0}}

# name: (family, mesh, parallel)
CASES = {
    "llama_zero3_tensor2_sp": (tiny.llama, {"data": 2, "tensor": 2}, {"zero_stage": 3, "sequence_parallel": True}),
    "llama_pipeline2_data2": (tiny.llama, {"data": 2, "pipeline": 2}, {"pipeline_schedule": "1f1b", "num_microbatches": 4}),
    "mixtral_expert2_data2": (tiny.mixtral, {"data": 2, "expert": 2}, {}),
    "llama_context2_data2_zero1": (tiny.llama, {"data": 2, "context": 2}, {"zero_stage": 1}),
    "llama_data4_accum2": (lambda train: tiny.llama({**train, "grad_accum": 2}), {"data": 4}, {}),
}


def _config(name):
    make, mesh, parallel = CASES[name]
    return tiny.with_overrides(make(dict(LORA)), mesh, parallel=parallel), math.prod(mesh.values())


@pytest.mark.parametrize("name", slow_except(CASES, "llama_zero3_tensor2_sp"))
def test_lora_matches_single_device(name, shared_cache):
    config, devices = _config(name)
    reference = single_device(shared_cache, config, STEPS)
    result = run(config, synthetic_batches(config, STEPS), devices, reference["init_params"])
    assert_matches_reference(result, reference)
    # Only adapters move; the base (every other leaf) is bitwise where it started, on both.
    for got in (result, reference):
        for a, b in zip(jax.tree.leaves(lora.base_of(got["final_params"])), jax.tree.leaves(lora.base_of(got["init_params"]))):
            np.testing.assert_array_equal(a, b)
        assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(got["final_params"]), jax.tree.leaves(got["init_params"])))
    # The base has no gradient and no optimizer state.
    assert all(not np.any(g) for g in jax.tree.leaves(lora.base_of(result["grads1"])))


@pytest.mark.slow
def test_lora_resume_is_bitwise_and_restores_onto_another_mesh(tmp_path):
    """Two steps, a checkpoint, then one more from it equal three straight, bitwise; the same
    checkpoint restored onto data 4 (no tensor) holds the same adapters and continues alike."""
    from jaxpar.checkpoint import Checkpoints, abstract_state

    config, devices = _config("llama_zero3_tensor2_sp")
    program = build(config, jax.devices()[:devices])
    batches = synthetic_batches(config, STEPS)
    state = program.init()
    for b in batches[:2]:
        state, _ = program.step(state, jax.device_put(b, program.batch_sharding))
    with Checkpoints(str(tmp_path), every_steps=0, keep=None) as checkpoints:
        checkpoints.save(2, program.to_natural(state), data_state={"step": 2}, config=config.to_json_best_effort(), force=True)
        checkpoints.wait()
    straight, straight_metrics = program.step(state, jax.device_put(batches[2], program.batch_sharding))
    straight = jax.device_get(program.to_natural(straight))

    def resumed_on(program):
        with Checkpoints(str(tmp_path), every_steps=0, read_only=True) as checkpoints:
            restored = checkpoints.restore(2, abstract_state(jax.eval_shape(program.init), program.state_shardings))
        state, metrics = program.step(program.to_storage(restored.state), jax.device_put(batches[2], program.batch_sharding))
        return jax.device_get(program.to_natural(state)), metrics

    same, metrics = resumed_on(program)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)
    assert float(metrics["loss"]) == float(straight_metrics["loss"])
    other = tiny.with_overrides(config, {"data": 4}, parallel={"zero_stage": 0, "sequence_parallel": False})
    moved, moved_metrics = resumed_on(build(other, jax.devices()[:4]))
    np.testing.assert_allclose(float(moved_metrics["loss"]), float(straight_metrics["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(lora.base_of(moved.params)), jax.tree.leaves(lora.base_of(straight.params))):
        np.testing.assert_array_equal(a, b)
    for (path, a), b in zip(lora.adapters_of(moved.params).items(), lora.adapters_of(straight.params).values()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(1.0, float(np.max(np.abs(b)))), err_msg=str(path))
