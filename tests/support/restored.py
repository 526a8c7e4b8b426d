"""What a restored train state must be: bit-identical to what was saved, on the shardings asked for."""

import jax
import numpy as np


def assert_identical(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def assert_on_shardings(restored, shardings):
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
        assert leaf.sharding.mesh.shape == sharding.mesh.shape, (leaf.sharding, sharding)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
