"""What the run's optimizer record (`jaxpar.optim`, `train.optimizer`) adds to the priced step:
its state bytes per device (memory) and, for Muon, the all-gathers of the momentum to whole
matrices before Newton-Schulz (communication) and the iteration's FLOPs.

Everything is read from the record: its `state` leaves (Adafactor's factored moments are not
parameter-shaped, SGD without momentum keeps nothing) sharded by the plan's optimizer-state rules
table, its `update_flops` (Muon's Newton-Schulz iterations, with its own `ns_steps`), and its
`gathers` (`jaxpar.optim.matrices.gathered_bytes`, which tests/optim/test_optimizers.py checks
against the compiled step's extra all-gather bytes). AdamW's two parameter-shaped moments give
exactly the `2 * as_optimizer * param bytes` the memory model used before.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from jaxpar import optim
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.cost.leaves import model_leaves as _model_leaves
from jaxpar.analysis.cost.leaves import shard_elements as _shard_elements
from jaxpar.analysis.cost.planned import Planned
from jaxpar.analysis.program.hlo import ALL_GATHER
from jaxpar.dtypes import DTYPE_BYTES
from jaxpar.models import lora
from jaxpar.optim import matrices
from jaxpar.sharding import rules_table

# Muon's update holds about this many copies of the gathered whole matrices at once (the gathered
# momentum, the iteration's X, X·Xᵀ, its polynomial and the next X, for every layer at once since the
# layers are vmapped): measured 6.8 on llama data 2 x tensor 4 ZeRO-1 (compiled temp 84.1 MB, of
# which AdamW's phase model gives 9.2 MB, over 11.0 MB of whole matrices). One measurement: a
# calibrated constant, not a derivation.
MUON_WORKING = 6.8


@dataclass(frozen=True)
class OptimizerTerms:
    state_bytes: int  # optimizer state on one device
    state_bytes_unsharded: int  # the whole model's optimizer state
    gathers: tuple  # ((mesh axes, whole-matrix bytes on one device), ...): Muon's all-gathers
    flops: int  # Newton-Schulz FLOPs on one device per step
    working: int  # temporaries of the update beyond AdamW's (Muon: the whole matrices and the iteration's)


def _spec(names, table) -> P:
    return P(*[tuple(table[n]) if n is not None and table[n] else None for n in names])


@functools.lru_cache(maxsize=4096)
def _terms(model_json: str, train_json: str, table_items: tuple, mesh_items: tuple) -> OptimizerTerms:
    """Keyed by the optimizer-state rules table and the mesh, not the whole plan: the planner's
    candidates differ mostly in knobs (remat, microbatches, schedule) these terms do not read."""
    train = ConfigDict(json.loads(train_json))
    record = optim.optimizer(train.optimizer)
    table, mesh = dict(table_items), dict(mesh_items)
    pb = DTYPE_BYTES[train.param_dtype]
    state = whole = flops = working = 0
    gathers: dict[tuple, float] = {}
    leaves = _model_leaves(model_json)
    adapting = any(lora.is_adapter(keys) for keys, _, _ in leaves)
    for keys, shape, names in leaves:
        if adapting and not lora.is_adapter(keys):  # LoRA's frozen base: no optimizer state, no update
            continue
        for leaf in record.state(train, tuple(shape), tuple(names)):
            itemsize = DTYPE_BYTES[leaf.dtype] if leaf.dtype else pb
            leaf_names = tuple(None if d is None else names[d] for d in leaf.dims)
            state += _shard_elements(leaf.shape(shape), leaf_names, table, mesh) * itemsize
            whole += math.prod(leaf.shape(shape)) * itemsize
        spec = _spec(names, table)
        if record.update_flops is not None:
            flops += record.update_flops(train, tuple(shape), tuple(names), spec, mesh)
        if record.gathers is None or matrices.matrix_dims(names) is None:
            continue
        if record.gathered_bytes(shape, names, spec, mesh):
            matrix, entries = matrices.matrix_dims(names), matrices._entries(spec, len(shape))
            local = math.prod(shape[d] // math.prod(mesh[a] for a in matrices._axes(entries[d])) for d in range(len(shape)))
            # XLA gathers one mesh axis at a time, the last matrix dim's axes first (measured:
            # data 2 x tensor 4 ZeRO-1, each axis's bytes exact); each gather's output is the
            # size so far times that axis.
            size = local * 4
            for d in reversed(matrix.dims):
                for axis in matrices._axes(entries[d]):
                    size *= mesh[axis]
                    gathers[(axis,)] = gathers.get((axis,), 0.0) + size
            working += size
    return OptimizerTerms(state, whole, tuple(sorted(gathers.items())), flops, round(MUON_WORKING * working))


def optimizer_terms(layout: Layout) -> OptimizerTerms:
    return layout.once(_layout_terms)


def _layout_terms(layout: Layout) -> OptimizerTerms:
    plan = layout.plan
    table = rules_table(plan, zero_on_params=plan.zero.shard_optimizer_state)
    return _terms(layout.model_json, layout.train_json, tuple(sorted(table.items())), plan.mesh_shape)


def optimizer_collectives(layout: Layout) -> list[Planned]:
    """Muon's momentum all-gathers to whole matrices, once per step (the cut back is a local slice)."""
    return [
        Planned(ALL_GATHER, axes, size, 1, "optimizer: momentum gathered to whole matrices (Muon)")
        for axes, size in optimizer_terms(layout).gathers
    ]


def state_bytes_per_param(config) -> float:
    """The optimizer record's state bytes per parameter, unsharded (AdamW: two moments)."""
    train, model = config.train, config.model
    record = optim.optimizer(train.optimizer)
    pb = DTYPE_BYTES[train.param_dtype]
    total = state = 0
    for _, shape, names in _model_leaves(model.to_json()):
        total += math.prod(shape)
        state += sum(
            math.prod(leaf.shape(shape)) * (DTYPE_BYTES[leaf.dtype] if leaf.dtype else pb)
            for leaf in record.state(train, tuple(shape), tuple(names))
        )
    return state / total
