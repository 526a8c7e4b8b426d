"""Layer stacks as pipeline stages: the `[L, ...]` storage layout viewed as `[p, v, Lc, ...]`.

Parameters keep their mesh-independent shapes ([L, ...] stacks, logical axis `layers`, which the
rules table maps to `pipeline` when it is > 1), so checkpoints stay portable. Entry [r, u] of the
staged view is global stage u·p + r, i.e. layers [(u·p + r)·Lc, (u·p + r + 1)·Lc), so the global
layer order is kept. For v = 1 that is a free reshape of the contiguous shards. For v > 1 rank r
needs the strided chunks r, p + r, ... while storage gives it the contiguous chunks r·v ... r·v +
v - 1: the engine transposes once per step (the partitioner emits an all-to-all +
collective-permute of the layer params, and the same for their gradients). Chosen over a
mesh-dependent storage order (breaks portable checkpoints) and over replicating the layers over
`pipeline` (p× the memory).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.axes import PIPELINE
from jaxpar.sharding import Rules, is_logical_names


def _stage_spec(rules: Rules, names) -> P:
    rest = tuple(rules.spec(names))[1:]
    return P(PIPELINE, None, None, *rest)


def to_stages(layers, logical, rules: Rules, p: int, v: int):
    """[L, ...] → [p, v, Lc, ...], entry [r, u] = global stage u·p + r, sharded over pipeline."""

    def one(a, names):
        chunk = a.shape[0] // (p * v)
        staged = a.reshape(v, p, chunk, *a.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(staged, NamedSharding(rules.mesh, _stage_spec(rules, names)))

    return jax.tree.map(one, layers, logical, is_leaf=is_logical_names)


def from_stages(staged, logical, rules: Rules):
    """The inverse of `to_stages`, back to the storage layout [L, ...]."""

    def one(a, names):
        flat = a.swapaxes(0, 1).reshape(-1, *a.shape[3:])
        return jax.lax.with_sharding_constraint(flat, rules.sharding(names))

    return jax.tree.map(one, staged, logical, is_leaf=is_logical_names)
