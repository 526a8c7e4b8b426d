"""Content fingerprints of a state pytree, independent of how its arrays are sharded.

zarr chunks are zstd-compressed without a checksum, so a flipped bit in a checkpoint's array store
restores silently as a wrong value (measured: flipping one byte in the middle of a data file gave a
clean restore with different numbers). Each save therefore records, per leaf, a weighted sum of the
leaf's raw bits, and each restore recomputes it on the restored arrays.

The sum is `Σ bits[i] * (2i + 1) mod 2**32` over the flat array: integer addition is exact and
associative, so the value does not depend on the mesh or on how XLA splits the reduction, and a
single flipped bit at any position changes it (the weight is odd, so `2**k * weight` is never
0 mod 2**32). The computation is one jitted program over the whole (global, possibly multi-process)
state; its output is replicated, so every process gets the same verdict.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_bits(x: jax.Array) -> jax.Array:
    """The leaf's raw bits as a flat uint32 vector (8-byte items become two words)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    return jax.lax.bitcast_convert_type(x, _UINT_OF_SIZE[size]).reshape(-1).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    bits = _leaf_bits(x)
    weights = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def leaf_names(tree) -> list[str]:
    """Dotted key paths of the leaves, e.g. `params.layers.mlp.up`."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in paths]


def _stacked_fingerprints(*leaves):
    return jnp.stack([_fingerprint(x) for x in leaves])


@functools.lru_cache(maxsize=8)
def _jitted(replicated: jax.sharding.Sharding):
    # One jit object per output sharding, so repeated saves of one state reuse the compiled program.
    return jax.jit(_stacked_fingerprints, out_shardings=replicated)


def _replicated_like(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise TypeError(f"fingerprints: leaves must have a NamedSharding or SingleDeviceSharding, got {sharding}")


def fingerprints(tree) -> dict[str, int]:
    """{leaf name: fingerprint} for a pytree of (global) jax.Arrays on one mesh."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return {}
    values = _jitted(_replicated_like(leaves[0].sharding))(*leaves)
    # Fully replicated, so every process may read it.
    return dict(zip(leaf_names(tree), (int(v) for v in np.asarray(values))))


def mismatches(saved: dict[str, int], restored: dict[str, int]) -> list[str]:
    """Leaf names whose fingerprints differ (or exist on one side only)."""
    return sorted(name for name in saved.keys() | restored.keys() if saved.get(name) != restored.get(name))
