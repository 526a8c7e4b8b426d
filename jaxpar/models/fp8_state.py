"""Delayed FP8 scaling's state (`train.fp8=delayed`): each module's amax histories, model state.

A module with FP8 matmuls holds one `Fp8History` leaf [matmuls, H + 1, 3] when the model config
carries `fp8_history` = H (`jaxpar.fp8.with_state`): per matmul, rows 0 .. H-1 the amaxes of its
input, its weight and its output's cotangent over the last H steps (row 0 the newest; the scales
of a step are their max, `jaxpar.kernels.fp8`), and a last row that stays 0. Being model state
(`jaxpar.models.state`) it is stacked over layers, staged by the pipeline, sharded and
checkpointed like any parameter, and set by its own rule, never by the optimizer: the matmul's VJP
puts the step's amaxes in row 0 of the gradient slot and 1 in row 1, so whatever positive constant
the gradient path scales and sums them by (microbatches, data replicas, the fp16 loss scale), the
ratio is the mean over microbatches of each microbatch's global amax.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxpar.kernels.fp8 import OBSERVED, WEIGHT
from jaxpar.models.state import ObservedState


class Fp8History(ObservedState):
    """[..., matmuls, H + 1, 3] amax histories (input, weight, cotangent) of a module's FP8 matmuls."""

    @staticmethod
    def update(previous, observation, **metadata):
        """The observed amaxes pushed in front; the oldest dropped."""
        del metadata
        observation = observation.astype(jnp.float32)
        weight = observation[..., WEIGHT : WEIGHT + 1, :]
        amax = jnp.where(weight > 0, observation[..., OBSERVED : OBSERVED + 1, :] / jnp.maximum(weight, 1e-30), 0.0)
        kept = previous[..., :-2, :].astype(jnp.float32)
        return jnp.concatenate([amax, kept, jnp.zeros_like(amax)], axis=-2)


def histories(cfg, matmuls: int) -> Fp8History | None:
    """A module's histories for its `matmuls` FP8 matmuls, or None when the run keeps none."""
    length = int(cfg.get("fp8_history", 0) or 0)
    if length <= 0:
        return None
    return Fp8History(jnp.zeros((matmuls, length + 1, 3), jnp.float32), out_sharding=(None, None, None))


def history_at(module_history, index: int):
    """Matmul `index`'s history [H + 1, 3] (None without state)."""
    return None if module_history is None else module_history[...][index]


def fp8_args(opts, name: str, module_history, index: int) -> dict:
    """`project`'s FP8 keywords for matmul `name`, the module's `index`-th: its scaling, its history."""
    return dict(fp8=opts.fp8_at(name), history=history_at(module_history, index))


def without_histories(params):
    """`params` without the `Fp8History` leaves: what a model without FP8 state (sampling, export)
    holds. The histories only steer training's scales."""
    if not isinstance(params, dict):
        return params
    return {k: without_histories(v) for k, v in params.items() if k != "fp8_history"}
