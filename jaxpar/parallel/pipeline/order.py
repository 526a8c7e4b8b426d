"""The layer stacks' order in the train state: `to_storage` and `to_natural`, the one home of that permutation.

When the plan stores the layer stacks in the schedule's order (`PipelineOptions.
layers_in_schedule_order`, decided by `options.stores_in_schedule_order`), the train state holds
every leaf that spans the layer dim — parameters, the optimizer's moments of them (AdamW's,
Adafactor's factored ones, Muon's momentum), model state such as the router bias — permuted along
that dim by `PipelineOptions.stored_order`, so the engine finds each rank's stages in its own
storage block every step (`layout.py`). Everything else sees the natural [L, ...] order: the state
is initialised in it (init never depends on the mesh) and permuted once (`to_storage`);
checkpoints are written in it (`to_natural` before a save, `to_storage` after a restore), so they
move across any split, schedule and mesh; the gradients a test reads come back in it. With no such
order both are the identity.

The permutation is done like the engine's stage exchange (`layout.to_stages` on a "split" of one
layer per stage, each placed at its target position): inside a `shard_map` over `pipeline`, each
rank sends what another's block needs by one `ppermute` per rank distance, so no rank ever holds
more than its block and what it receives (a plain gather of a sharded stack would be partitioned
as an all-gather of each whole stack).

`axes`: a tree shaped like the permuted tree, each leaf the axis that spans the layers, or -1
(`jaxpar.train.setup` derives it from the logical names and the optimizer's record).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline.layout import StageLayout, stage_layout, to_stages

NO_AXIS = -1


@functools.lru_cache(maxsize=16)
def _exchange(source: tuple, target: tuple, p: int) -> StageLayout:
    """Moves a stack stored in order `source` (the layer id at each position) into order `target`:
    layer i is a stage of one layer on the rank and local slot of its position in `target`."""
    block = len(source) // p
    at = {layer: i for i, layer in enumerate(target)}
    stages = tuple((at[i] // block, at[i] % block) for i in range(len(source)))
    return stage_layout((1,) * len(source), p, block, stages, source)


def _permute(tree, axes, mesh, layout: StageLayout):
    leaves, treedef = jax.tree.flatten(tree)
    where = jax.tree.leaves(axes)
    if len(where) != len(leaves):
        raise ValueError(f"layer axes for {len(where)} leaves, the tree has {len(leaves)}")
    picked = [i for i, axis in enumerate(where) if axis != NO_AXIS]
    if not picked:
        return tree
    stacks = [jnp.moveaxis(leaves[i], where[i], 0) for i in picked]
    tables = {k: jnp.asarray(t) for k, t in layout.tables.items()}

    def local(stacks, tables):
        return [s.reshape(-1, *s.shape[2:]) for s in to_stages(stacks, tables, layout)]

    moved = jax.shard_map(local, mesh=mesh, in_specs=(P(PIPELINE), P(PIPELINE)), out_specs=P(PIPELINE),
                          axis_names={PIPELINE})(stacks, tables)
    for i, stack in zip(picked, moved):
        leaves[i] = jnp.moveaxis(stack, 0, where[i])
    return jax.tree.unflatten(treedef, leaves)


def to_storage(tree, axes, pipe, mesh):
    """`tree` (natural [L] order along `axes`) in the plan's storage order; itself when the plan
    keeps the natural order. Traced: call inside a jit whose outputs carry the state's shardings."""
    order = None if pipe is None else pipe.stored_order
    if order is None:
        return tree
    return _permute(tree, axes, mesh, _exchange(tuple(range(len(order))), order, pipe.num_ranks))


def to_natural(tree, axes, pipe, mesh):
    """The inverse of `to_storage`."""
    order = None if pipe is None else pipe.stored_order
    if order is None:
        return tree
    return _permute(tree, axes, mesh, _exchange(order, tuple(range(len(order))), pipe.num_ranks))
