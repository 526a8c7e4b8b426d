"""LoRA on meshes against one device: the same losses, adapter gradients and adapters after three
steps as the one-device LoRA run, the frozen base bitwise as it started, for a dense family under
data 2 ZeRO-3 x tensor 2 (SP), a pipeline, and Mixtral under expert 2; and a resumed run that
continues bitwise on the same mesh."""

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
def test_lora_resume_is_bitwise():
    """Two steps, then one more from a copy of the state, equal three steps straight."""
    config, devices = _config("llama_zero3_tensor2_sp")
    program = build(config, jax.devices()[:devices])
    batches = [jax.device_put(b, program.batch_sharding) for b in synthetic_batches(config, STEPS)]
    state = program.init()
    for b in batches[:2]:
        state, _ = program.step(state, b)
    saved = jax.device_get(program.to_natural(state))
    straight, _ = program.step(state, batches[2])
    restored = program.to_storage(jax.device_put(saved, program.state_shardings))
    resumed, _ = program.step(restored, batches[2])
    for a, b in zip(jax.tree.leaves(jax.device_get(straight)), jax.tree.leaves(jax.device_get(resumed))):
        np.testing.assert_array_equal(a, b)
