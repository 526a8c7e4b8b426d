"""Shared helpers for degeneracy tests: run a config on some mesh, compare with one device."""

from __future__ import annotations

import copy

import jax
import numpy as np

from jaxpar.config import MESH_AXES
from jaxpar.train.setup import build
from jaxpar.train.step import loss_and_grads


def with_overrides(config, mesh: dict, **sections):
    """A copy of `config` with mesh sizes (unnamed axes → 1) and `section={key: value}` overrides."""
    config = copy.deepcopy(config)
    config.mesh.update({name: mesh.get(name, 1) for name in MESH_AXES})
    for section, values in sections.items():
        config[section].update(values)
    return config


def synthetic_batches(config, steps: int, seed: int = 0, distinct_tokens: int = 16):
    """Random batches over a few token ids, so that three steps visibly lower the loss."""
    rng = np.random.default_rng(seed)
    shape = (config.train.global_batch_size, config.train.seq_len + 1)
    ids = rng.choice(config.model.vocab_size, distinct_tokens, replace=False)
    return [ids[rng.integers(0, distinct_tokens, shape)].astype(np.int32) for _ in range(steps)]


def run(config, batches, num_devices: int):
    """Initial params, step-1 loss and gradients, and per-step losses, all as numpy."""
    program = build(config, jax.devices()[:num_devices])
    state = program.init()
    init_params = jax.device_get(state.params)
    grad_fn = jax.jit(
        lambda params, batch: loss_and_grads(
            params, batch, model_config=config.model, opts=program.opts, accum=config.train.grad_accum
        ),
        in_shardings=(program.state_shardings.params, program.batch_sharding),
    )
    first = jax.device_put(batches[0], program.batch_sharding)
    loss1, grads1, _ = jax.device_get(grad_fn(state.params, first))
    losses = []
    for batch in batches:
        state, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return dict(init_params=init_params, loss1=float(loss1), grads1=grads1, losses=np.array(losses))


def max_relative_error(tree, reference) -> float:
    """max over leaves of max|x - ref| / max|ref|."""
    errors = jax.tree.map(lambda x, r: float(np.max(np.abs(x - r)) / max(np.max(np.abs(r)), 1e-30)), tree, reference)
    return max(jax.tree.leaves(errors))


def assert_matches_reference(result, reference, grad_rtol=1e-5, loss_rtol=1e-4):
    for a, b in zip(jax.tree.leaves(result["init_params"]), jax.tree.leaves(reference["init_params"])):
        np.testing.assert_array_equal(a, b, err_msg="initial params depend on the mesh")
    assert abs(result["loss1"] - reference["loss1"]) <= grad_rtol * abs(reference["loss1"])
    err = max_relative_error(result["grads1"], reference["grads1"])
    assert err <= grad_rtol, f"step-1 gradients differ from one device by {err:.2e} (relative)"
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=loss_rtol)
