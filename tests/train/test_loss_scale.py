"""fp16 dynamic loss scaling: overflowing steps are skipped and counted, with one global verdict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.train.loss_scale import LossScale
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.reference import synthetic_batches


def test_scale_halves_on_overflow_and_doubles_after_period():
    scale = LossScale.create(dynamic=True, initial_scale=1024.0, period=2)
    scale = scale.update(jnp.asarray(False))
    assert float(scale.scale) == 512.0 and int(scale.skipped_steps) == 1
    scale = scale.update(jnp.asarray(True))
    assert float(scale.scale) == 512.0 and int(scale.good_steps) == 1
    scale = scale.update(jnp.asarray(True))
    assert float(scale.scale) == 1024.0 and int(scale.good_steps) == 0
    static = LossScale.create(dynamic=False, initial_scale=1024.0, period=2)
    assert float(static.update(jnp.asarray(False)).scale) == 1.0


# fp16 rounds activations to 11 mantissa bits, at different points on different layouts;
# measured: 1.2e-4 worst relative loss difference between 1 and 8 devices over these 6 steps.
FP16_LOSS_RTOL = 1e-3


def fp16_run(mesh, devices, steps=6):
    # 2^20 overflows fp16 gradients for certain: the first steps must be skipped until the scale fits.
    config = tiny.with_overrides(
        tiny.llama({"compute_dtype": "float16", "loss_scale_init": 2.0**20, "steps": steps}), mesh
    )
    program = build(config, jax.devices()[:devices])
    state = program.init()
    initial = jax.device_get(state.params)
    history = []
    for batch in synthetic_batches(config, steps):
        state, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
        history.append({k: float(v) for k, v in jax.device_get(metrics).items() if k != "learning_rate"})
    return initial, jax.device_get(state.params), history, int(state.step)


@pytest.mark.slow
def test_overflow_skips_step_identically_on_one_and_eight_devices():
    init1, final1, hist1, updates1 = fp16_run({}, 1)
    init8, final8, hist8, updates8 = fp16_run({"data": 4, "tensor": 2}, 8)
    skipped = [h["skipped_steps"] for h in hist1]
    # The first step overflowed and was skipped; the scale halved after each skip.
    assert skipped[0] == 1
    assert hist1[1]["loss_scale"] == hist1[0]["loss_scale"] / 2
    assert 0 < skipped[-1] < len(hist1), "some steps must be skipped and some applied"
    assert updates1 == len(hist1) - skipped[-1]
    # The verdict is global: every device skipped the same steps as the single device.
    assert [h["skipped_steps"] for h in hist8] == skipped
    assert [h["loss_scale"] for h in hist8] == [h["loss_scale"] for h in hist1]
    assert updates8 == updates1
    # fp16 losses agree across meshes to fp16 precision (the skipped steps' losses overflow alike).
    losses1 = np.array([h["loss"] for h in hist1])
    losses8 = np.array([h["loss"] for h in hist8])
    finite = np.isfinite(losses1)
    assert finite.sum() >= 3, losses1
    np.testing.assert_array_equal(np.isfinite(losses8), finite)
    np.testing.assert_allclose(losses8[finite], losses1[finite], rtol=FP16_LOSS_RTOL)
    # Params really moved on applied steps only (an all-skipped run would leave them at init).
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(final1), jax.tree.leaves(init1)))
    assert moved > 0
