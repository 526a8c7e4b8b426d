"""Model state: parameter leaves the train step sets from what the forward observed, not the optimizer.

An `ObservedState` variable (e.g. loss-free balancing's router bias, `jaxpar.models.moe.RouterBias`)
lives in the params tree, so it is stacked over layers, sharded by its logical names, staged by the
pipeline, gathered by ZeRO-3 and checkpointed like any parameter, with no plumbing of its own. The
forward makes its *gradient slot* carry the observation: it adds to the loss a term that is exactly
zero but whose derivative with respect to the variable is the observation (`probe`). So every
gradient path (plain, accumulated, per context rank, pipelined) delivers it summed over the batch
like any gradient, scaled by a positive constant (1 / microbatches, 1 / data replicas ...) that the
update must not depend on. The step then takes the observation out of the gradients before
clipping and the optimizer (`take_observations`), and replaces the optimizer's result for the leaf
by the variable's own rule applied to its previous value (`update_state`).

The forward reads the variable at its stored dtype (`jaxpar.models.apply` does not cast it), so
without the pipeline the observation is exact fp32; the pipeline engine casts every layer leaf to
the compute dtype, so in 16-bit pipelined runs observations are 16-bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class ObservedState(nnx.Param):
    """A leaf set by `update(previous, observation, **metadata)` after each step, not trained."""

    @staticmethod
    def update(previous, observation, **metadata):
        raise NotImplementedError


def probe(value, observation):
    """Zero, with d/d value = observation (stop-gradient on the observation): added to the loss,
    it makes the gradient slot of `value` carry `observation`."""
    observation = jax.lax.stop_gradient(observation).astype(jnp.float32)
    return jnp.sum(observation * (value - jax.lax.stop_gradient(value)).astype(jnp.float32))


def _leaves(abstract_state) -> dict:
    """{path: (variable type, metadata)} of the ObservedState leaves of an nnx state."""
    return {
        tuple(path): (type(v), v.get_metadata())
        for path, v in nnx.to_flat_state(abstract_state)
        if isinstance(v, ObservedState)
    }


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _replace(tree, path, value):
    """A copy of the nested dict `tree` with the leaf at `path` replaced (other leaves shared)."""
    if not path:
        return value
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}


def state_mask(params, abstract_state):
    """`params`' tree with True at the ObservedState leaves, False elsewhere."""
    mask = jax.tree.map(lambda _: False, params)
    for path in _leaves(abstract_state):
        mask = _replace(mask, path, True)
    return mask


def take_observations(grads, abstract_state):
    """(grads with the ObservedState leaves zeroed, {path: observation}) — identity when none."""
    observations = {}
    for path in _leaves(abstract_state):
        observations[path] = _get(grads, path)
        grads = _replace(grads, path, jnp.zeros_like(observations[path]))
    return grads, observations


def update_state(params, previous, observations: dict, abstract_state):
    """`params` (the optimizer's result) with each ObservedState leaf replaced by its rule applied
    to its value in `previous` (before the step) and its observation."""
    for path, (kind, metadata) in _leaves(abstract_state).items():
        old = _get(previous, path)
        params = _replace(params, path, kind.update(old, observations[path], **metadata).astype(old.dtype))
    return params
