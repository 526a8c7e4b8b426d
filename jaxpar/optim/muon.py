"""Muon's matrix part: momentum orthogonalised by Newton–Schulz, one matrix at a time.

The arithmetic is optax's (`optax.contrib.muon` 0.2.8: the same bias-corrected (Nesterov)
momentum, its `orthogonalize_via_newton_schulz` with the standard quintic coefficients and
Frobenius pre-scaling, its shape scaling). What jaxpar adds is where it runs: the leading
`layers` / `experts` dims are vmapped over rather than flattened (flattening would merge an
expert-sharded dim into the layers dim, a layout change the partitioner can only make by
gathering), and the momentum is gathered to whole matrices once before the iteration and cut back
to the optimizer-state layout after it (`jaxpar.optim.matrices`), instead of leaving the
iteration's matmuls to the partitioner (measured: a gather at every matmul, 10x the bytes). `tests/train/test_oracle.py` compares five steps
with `optax.contrib.muon` applied per matrix by hand; `tests/optim/test_optimizer_degeneracy.py` every
layout with one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

# Not re-exported by optax.contrib (0.2.8); the function optax.contrib.muon itself runs.
from optax.contrib._muon import MuonDimensionNumbers, orthogonalize_via_newton_schulz

from jaxpar.optim.matrices import MatrixDims

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # optax's (and Keller Jordan's) default quintic
NS_EPS = 1e-8


class MuonState(NamedTuple):
    count: jax.Array
    mu: Any


@dataclass(frozen=True)
class Matrix:
    """One Muon leaf: its matrix dims and, on a mesh, the whole-matrix and state layouts."""

    dims: MatrixDims
    whole: NamedSharding | None = None
    state: NamedSharding | None = None

    def orthogonalize(self, x, ns_steps: int, consistent_rms: float):
        if self.whole is not None:
            x = jax.lax.with_sharding_constraint(x, self.whole)
        batch = self.dims.batch
        numbers = MuonDimensionNumbers(
            tuple(d - batch for d in self.dims.inputs), tuple(d - batch for d in self.dims.outputs)
        )
        coeffs = jnp.asarray(NS_COEFFS, x.dtype)
        fn = lambda m: orthogonalize_via_newton_schulz(m, coeffs, ns_steps, "frobenius", NS_EPS, numbers)  # noqa: E731
        for _ in range(batch):
            fn = jax.vmap(fn)
        fan_in, fan_out = self.dims.fans(x.shape)
        # optax.contrib.muon's scale_by_shape: Moonlight's consistent RMS, or Keller Jordan's width rule.
        scale = (max(fan_in, fan_out) ** 0.5) * consistent_rms if consistent_rms else max(1.0, fan_out / fan_in) ** 0.5
        y = fn(x)
        if self.whole is not None:
            # Pinned whole on both sides: otherwise the state layout below propagates back into the
            # iteration, which the partitioner then splits with a gather per matmul (measured: 119
            # all-gathers, 10x the bytes of this one).
            y = jax.lax.with_sharding_constraint(y, self.whole)
        y = y * scale
        return y if self.state is None else jax.lax.with_sharding_constraint(y, self.state)


def scale_by_muon(matrices, *, beta: float, ns_steps: int, nesterov: bool, consistent_rms: float):
    """`matrices`: the params tree with a `Matrix` at each Muon leaf and None elsewhere (those leaves
    arrive masked when this runs inside `optax.partition`)."""

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        mu = jax.tree.map(lambda new, old: new.astype(old.dtype), mu, state.mu)  # bf16 params keep bf16 state
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, beta, count),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        out = jax.tree.map(
            lambda m, x: x if m is None else m.orthogonalize(x, ns_steps, consistent_rms),
            matrices, mu_hat, is_leaf=lambda x: x is None,
        )
        return out, MuonState(count, mu)

    return optax.GradientTransformation(init, update)
