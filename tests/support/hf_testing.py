"""Small helpers shared by the transformers-parity tests."""

import jax
import numpy as np


def tokens_for(model):
    return np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)
