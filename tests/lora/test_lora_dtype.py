"""LoRA's frozen base held in the compute dtype (train.lora.base_in_compute_dtype): with bf16 compute
the forward casts the base to bf16 anyway, so three steps are bitwise the steps of the run that
holds it in fp32 (losses, gradient norms, adapters), on a quarter less memory for the base's bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.models import lora
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.reference import synthetic_batches


def _run(held_low: bool):
    config = tiny.llama(dict(compute_dtype="bfloat16", lora=dict(rank=4, alpha=8.0, base_in_compute_dtype=held_low)))
    program = build(config, jax.devices()[:1])
    state, losses = program.init(), []
    for batch in synthetic_batches(config, 3):
        state, metrics = program.step(state, batch)
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return jax.device_get(state.params), losses


@pytest.mark.slow
def test_base_in_compute_dtype_trains_bitwise_alike():
    low, low_losses = _run(True)
    high, high_losses = _run(False)
    assert {x.dtype for x in jax.tree.leaves(lora.base_of(low))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in lora.adapters_of(low).values()} == {jnp.dtype(jnp.float32)}
    assert low_losses == high_losses
    for a, b in zip(lora.adapters_of(low).values(), lora.adapters_of(high).values()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(lora.base_of(low)), jax.tree.leaves(lora.base_of(high))):
        np.testing.assert_array_equal(a, np.asarray(b).astype(jnp.bfloat16))
