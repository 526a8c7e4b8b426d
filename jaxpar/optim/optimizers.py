"""The optimizers (`train.optimizer`), one record each: how to build it, its hyperparameter keys,
the state it keeps per parameter, and what that state costs.

Every optimizer runs after global-norm clipping (`train.max_grad_norm`) and takes the learning
rate from the schedule (`jaxpar.optim.schedules`). `train.weight_decay` is decoupled and
multiplied by the learning rate, AdamW-style, for every optimizer except `sgd`, where it is
L2 added to the gradient before momentum (as `torch.optim.SGD`); it applies where the decay mask
(`decay_mask`) says so.

- `adamw` (default): `optax.adamw` (`adam_b1`, `adam_b2`, `adam_eps`) — today's behaviour, bitwise.
- `adafactor`: optax's factored second moment (`adafactor_decay_rate`, factored over the two
  largest dims once both are >= `adafactor_min_dim_to_factor`), update clipping at RMS
  `adafactor_clipping_threshold` (0: off) and the relative step (times the parameter's RMS), both
  per matrix (`jaxpar.optim.matrices`), optional momentum `adafactor_momentum` (0: none). The
  learning rate is applied last, so weight decay means what it means for AdamW.
- `lion`: `optax.lion` (`lion_b1`, `lion_b2`).
- `muon`: Muon (`jaxpar.optim.muon`: `muon_beta`, `muon_ns_steps`, `muon_nesterov`,
  `muon_consistent_rms`; 0: Keller Jordan's width scaling) on the layers' weight matrices, AdamW
  (`adam_*`) on embeddings, LM head, norm scales and the MoE router, one learning rate for both
  (consistent RMS 0.2 matches AdamW's update size, Liu et al. 2025).
- `sgd`: `optax.sgd` with `sgd_momentum` (0: none) and `sgd_nesterov`.

A record's `state` lists, for a parameter's shape and logical names, the state leaves optax keeps
for it: each leaf's field (the optax state attribute holding it) and which of the parameter's dims
it spans. `jaxpar.optim.state` derives every state leaf's sharding from that (ZeRO included), so a
non-parameter-shaped leaf (Adafactor's factored moments) is sharded like the dims it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.optim import matrices, muon
from jaxpar.ranges import at_least, within
from jaxpar.sharding import is_logical_names


@dataclass(frozen=True)
class StateLeaf:
    """One state array an optimizer keeps for a parameter."""

    field: str  # the optax state attribute it lives under (mu, nu, v_row, ...)
    dims: tuple  # the parameter dims it spans, in order; None: a dim of size 1
    dtype: str | None = None  # None: the parameter's dtype

    def shape(self, param_shape) -> tuple[int, ...]:
        return tuple(1 if d is None else param_shape[d] for d in self.dims)

    def nbytes(self, param_shape, param_dtype) -> int:
        return math.prod(self.shape(param_shape)) * jnp.dtype(self.dtype or param_dtype).itemsize


@dataclass(frozen=True)
class Optimizer:
    name: str  # `train.optimizer`
    # (config.train, schedule, logical axes tree, decay-mask tree, param-shaped state shardings or
    # None) -> the optax transformation applied after clipping.
    build: Callable
    hyperparameters: tuple[str, ...]  # train keys only it reads; they must match to resume
    state: Callable  # (config.train, param shape, logical names) -> tuple[StateLeaf, ...]
    checks: Callable  # (config.train, config.model) -> one line per problem
    # Bytes one device receives per step gathering whole matrices (Muon), as
    # (param shape, logical names, optimizer-state PartitionSpec, mesh sizes) -> int; None: nothing.
    gathers: Callable | None = None

    def state_bytes(self, train, shape, names, param_dtype=jnp.float32) -> int:
        """Optimizer-state bytes this parameter costs (unsharded; scalars such as step counts not counted)."""
        return sum(leaf.nbytes(shape, param_dtype) for leaf in self.state(train, tuple(shape), tuple(names)))

    def gathered_bytes(self, shape, names, spec, mesh_sizes) -> int:
        return 0 if self.gathers is None else self.gathers(tuple(shape), tuple(names), spec, mesh_sizes)


def _all(shape) -> tuple[int, ...]:
    return tuple(range(len(shape)))


def _map_names(fn, logical):
    return jax.tree.map(fn, logical, is_leaf=is_logical_names)


# adamw


def _adamw(train, schedule, logical, mask, layouts):
    del logical, layouts
    return optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps, weight_decay=train.weight_decay, mask=mask)


def _adam_state(train, shape, names):
    return (StateLeaf("mu", _all(shape)), StateLeaf("nu", _all(shape)))


def _adam_checks(train, model):
    return []  # adam_b1, adam_b2, adam_eps: `jaxpar.train.checks.train_ranges` (muon uses them too)


ADAM_KEYS = ("adam_b1", "adam_b2", "adam_eps")

# adafactor


def factored_dims(shape, min_dim: int) -> tuple[int, int] | None:
    """optax's choice (`scale_by_factored_rms`): the two largest dims (second largest, largest) when
    the second largest is >= min_dim. Same argsort, so ties resolve as optax resolves them."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


def _adafactor(train, schedule, logical, mask, layouts):
    del layouts
    batch = _map_names(matrices.batch_dims, logical)
    steps = [optax.scale_by_factored_rms(decay_rate=train.adafactor_decay_rate, min_dim_size_to_factor=train.adafactor_min_dim_to_factor)]
    if train.adafactor_clipping_threshold > 0:
        steps.append(matrices.clip_by_matrix_rms(train.adafactor_clipping_threshold, batch))
    steps.append(matrices.scale_by_matrix_param_rms(batch))
    if train.adafactor_momentum > 0:
        steps.append(optax.ema(train.adafactor_momentum, debias=False, accumulator_dtype=jnp.float32))
    steps += [optax.add_decayed_weights(train.weight_decay, mask), optax.scale_by_learning_rate(schedule)]
    return optax.chain(*steps)


def _adafactor_state(train, shape, names):
    factored = factored_dims(shape, train.adafactor_min_dim_to_factor)
    if factored is None:
        leaves = [StateLeaf("v_row", (None,)), StateLeaf("v_col", (None,)), StateLeaf("v", _all(shape))]
    else:
        d1, d0 = factored  # optax: v_row drops the largest dim, v_col the second largest
        keep = lambda drop: tuple(d for d in _all(shape) if d != drop)  # noqa: E731
        leaves = [StateLeaf("v_row", keep(d0)), StateLeaf("v_col", keep(d1)), StateLeaf("v", (None,))]
    if train.adafactor_momentum > 0:
        leaves.append(StateLeaf("ema", _all(shape), "float32"))
    return tuple(leaves)


def _adafactor_checks(train, model):
    errors = within("train.adafactor_decay_rate", train.adafactor_decay_rate, 0.0, 1.0)
    errors += at_least("train.adafactor_clipping_threshold", train.adafactor_clipping_threshold, 0.0)
    errors += within("train.adafactor_momentum", train.adafactor_momentum, 0.0, 1.0, high_open=True)
    # Stacked layers / experts are batch dims: factoring over one would mix matrices.
    stacked = max(model.num_hidden_layers, model.get("num_local_experts", 1))
    if train.adafactor_min_dim_to_factor <= stacked:
        errors.append(
            f"train.adafactor_min_dim_to_factor={train.adafactor_min_dim_to_factor} must exceed the stacked layer / expert "
            f"count {stacked} (those dims are never factored); raise it"
        )
    return errors


# lion


def _lion(train, schedule, logical, mask, layouts):
    del logical, layouts
    return optax.lion(schedule, b1=train.lion_b1, b2=train.lion_b2, weight_decay=train.weight_decay, mask=mask)


def _lion_state(train, shape, names):
    return (StateLeaf("mu", _all(shape)),)


def _lion_checks(train, model):
    return [e for k in ("lion_b1", "lion_b2") for e in within(f"train.{k}", train[k], 0.0, 1.0, high_open=True)]


# muon


def _muon(train, schedule, logical, mask, layouts):
    dims = _map_names(matrices.matrix_dims, logical)

    def leaf(matrix, sharding, names):
        if matrix is None:
            return None
        if sharding is None:
            return muon.Matrix(matrix)
        return muon.Matrix(matrix, matrices.whole_matrix_sharding(sharding, matrix, len(names)), sharding)

    is_leaf = lambda x: x is None or isinstance(x, matrices.MatrixDims)  # noqa: E731
    shardings = layouts if layouts is not None else jax.tree.map(lambda _: None, dims, is_leaf=is_leaf)
    plan = jax.tree.map(leaf, dims, shardings, logical, is_leaf=lambda x: is_leaf(x) or is_logical_names(x))
    labels = jax.tree.map(lambda m: "adam" if m is None else "muon", dims, is_leaf=is_leaf)
    matrix_part = optax.chain(
        muon.scale_by_muon(
            plan, beta=train.muon_beta, ns_steps=train.muon_ns_steps, nesterov=train.muon_nesterov,
            consistent_rms=train.muon_consistent_rms,
        ),
        optax.add_decayed_weights(train.weight_decay, mask),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": matrix_part, "adam": _adamw(train, schedule, logical, mask, None)}, labels)


def _muon_state(train, shape, names):
    return (StateLeaf("mu", _all(shape)),) if matrices.matrix_dims(names) is not None else _adam_state(train, shape, names)


def _muon_checks(train, model):
    errors = within("train.muon_beta", train.muon_beta, 0.0, 1.0, high_open=True)
    errors += at_least("train.muon_ns_steps", train.muon_ns_steps, 1)
    return errors + at_least("train.muon_consistent_rms", train.muon_consistent_rms, 0.0)


def _muon_gathers(shape, names, spec, mesh_sizes):
    return matrices.gathered_bytes(shape, names, spec, mesh_sizes)


# sgd


def _sgd(train, schedule, logical, mask, layouts):
    del logical, layouts
    momentum = train.sgd_momentum or None
    return optax.chain(optax.add_decayed_weights(train.weight_decay, mask), optax.sgd(schedule, momentum, train.sgd_nesterov))


def _sgd_state(train, shape, names):
    return (StateLeaf("trace", _all(shape)),) if train.sgd_momentum > 0 else ()


def _sgd_checks(train, model):
    return within("train.sgd_momentum", train.sgd_momentum, 0.0, 1.0, high_open=True)


OPTIMIZERS = (
    Optimizer("adamw", _adamw, ADAM_KEYS, _adam_state, _adam_checks),
    Optimizer(
        "adafactor", _adafactor,
        ("adafactor_decay_rate", "adafactor_min_dim_to_factor", "adafactor_clipping_threshold", "adafactor_momentum"),
        _adafactor_state, _adafactor_checks,
    ),
    Optimizer("lion", _lion, ("lion_b1", "lion_b2"), _lion_state, _lion_checks),
    Optimizer(
        "muon", _muon, ("muon_beta", "muon_ns_steps", "muon_nesterov", "muon_consistent_rms", *ADAM_KEYS),
        _muon_state, _muon_checks, gathers=_muon_gathers,
    ),
    Optimizer("sgd", _sgd, ("sgd_momentum", "sgd_nesterov"), _sgd_state, _sgd_checks),
)
OPTIMIZER_NAMES = tuple(o.name for o in OPTIMIZERS)


def optimizer(name: str) -> Optimizer:
    for record in OPTIMIZERS:
        if record.name == name:
            return record
    raise ValueError(f"train.optimizer={name!r} is not one of {OPTIMIZER_NAMES}")
