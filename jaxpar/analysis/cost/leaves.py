"""The model's parameter leaves (path, shape, logical names) and their per-device element counts
under a rules table: what the memory, communication and optimizer terms of the analysis count."""

from __future__ import annotations

import functools
import json
import math

import jax
from ml_collections import ConfigDict

from jaxpar import models


@functools.lru_cache(maxsize=64)
def model_leaves(model_json: str) -> tuple:
    """((path keys, shape, logical names), ...) of the model's parameters; cached because the
    planner prices thousands of layouts of one model (abstract init costs milliseconds)."""
    model = ConfigDict(json.loads(model_json))
    shapes, logical = models.param_shapes(model), models.logical_axes(model)
    return tuple(
        (tuple(getattr(k, "key", str(k)) for k in path), leaf.shape, names)
        for (path, leaf), names in zip(
            jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
        )
    )


def shard_elements(shape, names, table, mesh, drop=()) -> int:
    total = 1
    for dim, name in zip(shape, names):
        axes = [a for a in (table[name] if name is not None else ()) if a not in drop]
        total *= -(-dim // math.prod(mesh[a] for a in axes))
    return total
