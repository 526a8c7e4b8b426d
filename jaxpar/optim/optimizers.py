"""The optimizers (`train.optimizer`), one record each: how to build it, its hyperparameter keys,
the state it keeps per parameter, and what that state costs.

Every optimizer runs after global-norm clipping (`train.max_grad_norm`) and takes the learning
rate from the schedule (`jaxpar.optim.schedules`). `train.weight_decay` is decoupled and
multiplied by the learning rate, AdamW-style, for every optimizer except `sgd`, where it is
L2 added to the gradient before momentum (as `torch.optim.SGD`); it applies where the decay mask
(`decay_mask`) says so.

Each record's hyperparameters are the keys of its own section, `train.<name>.<key>`, declared on
the record (`Hyperparameter`: default, meaning, range; `jaxpar.optim.hyperparameters`):

- `adamw` (default): `optax.adamw` (`adamw.b1`, `adamw.b2`, `adamw.eps`) — today's behaviour, bitwise.
- `adafactor`: optax's factored second moment (`adafactor.decay_rate`, factored over the two
  largest dims once both are >= `adafactor.min_dim_to_factor`), update clipping at RMS
  `adafactor.clipping_threshold` (0: off) and the relative step (times the parameter's RMS), both
  per matrix (`jaxpar.optim.matrices`), optional momentum `adafactor.momentum` (0: none). The
  learning rate is applied last, so weight decay means what it means for AdamW.
- `lion`: `optax.lion` (`lion.b1`, `lion.b2`).
- `muon`: Muon (`jaxpar.optim.muon`: `muon.beta`, `muon.ns_steps`, `muon.nesterov`,
  `muon.consistent_rms`; 0: Keller Jordan's width scaling) on the layers' weight matrices, AdamW
  on embeddings, LM head, norm scales and the MoE router with adamw's keys (the record `reads`
  adamw's section), one learning rate for both (consistent RMS 0.2 matches AdamW's update size,
  Liu et al. 2025).
- `sgd`: `optax.sgd` with `sgd.momentum` (0: none) and `sgd.nesterov`.

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
from jaxpar.optim.hyperparameters import DECAY, FRACTION, NON_NEGATIVE, POSITIVE, Hyperparameter, Range
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


def _no_checks(train, model) -> list[str]:
    return []


@dataclass(frozen=True)
class Optimizer:
    name: str  # `train.optimizer`, and its section `train.<name>`
    # (config.train, schedule, logical axes tree, decay-mask tree, param-shaped state shardings or
    # None) -> the optax transformation applied after clipping.
    build: Callable
    # The keys of its section `train.<name>` (ranges checked by preflight); they, and those of the
    # sections it `reads`, must match to resume (what its saved state means).
    hyperparameters: tuple[Hyperparameter, ...]
    state: Callable  # (config.train, param shape, logical names) -> tuple[StateLeaf, ...]
    # (config.train, config.model) -> one line per problem beyond each key's own range.
    checks: Callable = _no_checks
    reads: tuple[str, ...] = ()  # other optimizers whose sections it reads too (muon: adamw's)
    # Bytes one device receives per step gathering whole matrices (Muon), as
    # (param shape, logical names, optimizer-state PartitionSpec, mesh sizes) -> int; None: nothing.
    gathers: Callable | None = None
    # FLOPs one device spends per step on a parameter's update beyond elementwise work (Muon's
    # Newton–Schulz), as (config.train, param shape, logical names, PartitionSpec, mesh sizes) -> int.
    update_flops: Callable | None = None

    @property
    def sections(self) -> tuple[str, ...]:
        """The `train.` sections it reads: its own, then those it `reads`."""
        return (self.name, *self.reads)

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
    adam = train.adamw
    return optax.adamw(schedule, b1=adam.b1, b2=adam.b2, eps=adam.eps, weight_decay=train.weight_decay, mask=mask)


def _adam_state(train, shape, names):
    return (StateLeaf("mu", _all(shape)), StateLeaf("nu", _all(shape)))


ADAMW_KEYS = (
    Hyperparameter("b1", 0.9, "decay of the first moment (the gradient's running mean)", DECAY, was="adam_b1"),
    Hyperparameter("b2", 0.95, "decay of the second moment (the squared gradient's running mean)", DECAY, was="adam_b2"),
    Hyperparameter("eps", 1e-8, "added to the second moment's root before dividing", POSITIVE, was="adam_eps"),
)

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
    keys = train.adafactor
    steps = [optax.scale_by_factored_rms(decay_rate=keys.decay_rate, min_dim_size_to_factor=keys.min_dim_to_factor)]
    if keys.clipping_threshold > 0:
        steps.append(matrices.clip_by_matrix_rms(keys.clipping_threshold, batch))
    steps.append(matrices.scale_by_matrix_param_rms(batch))
    if keys.momentum > 0:
        steps.append(optax.ema(keys.momentum, debias=False, accumulator_dtype=jnp.float32))
    steps += [optax.add_decayed_weights(train.weight_decay, mask), optax.scale_by_learning_rate(schedule)]
    return optax.chain(*steps)


def _adafactor_state(train, shape, names):
    factored = factored_dims(shape, train.adafactor.min_dim_to_factor)
    if factored is None:
        leaves = [StateLeaf("v_row", (None,)), StateLeaf("v_col", (None,)), StateLeaf("v", _all(shape))]
    else:
        d1, d0 = factored  # optax: v_row drops the largest dim, v_col the second largest
        keep = lambda drop: tuple(d for d in _all(shape) if d != drop)  # noqa: E731
        leaves = [StateLeaf("v_row", keep(d0)), StateLeaf("v_col", keep(d1)), StateLeaf("v", (None,))]
    if train.adafactor.momentum > 0:
        leaves.append(StateLeaf("ema", _all(shape), "float32"))
    return tuple(leaves)


def _adafactor_checks(train, model):
    # Stacked layers / experts are batch dims: factoring over one would mix matrices.
    stacked = max(model.num_hidden_layers, model.get("num_local_experts", 1))
    min_dim = train.adafactor.min_dim_to_factor
    if min_dim <= stacked:
        return [
            f"train.adafactor.min_dim_to_factor={min_dim} must exceed the stacked layer / expert "
            f"count {stacked} (those dims are never factored); raise it"
        ]
    return []


ADAFACTOR_KEYS = (
    Hyperparameter("decay_rate", 0.8, "the factored second moment's decay exponent (optax's decay_rate)", FRACTION,
                   was="adafactor_decay_rate"),
    Hyperparameter("min_dim_to_factor", 128, "a matrix is factored once its two largest dims are at least this "
                   "(and above the stacked layer / expert count)", was="adafactor_min_dim_to_factor"),
    Hyperparameter("clipping_threshold", 1.0, "clip each matrix's update at this RMS (0: no update clipping)", NON_NEGATIVE,
                   was="adafactor_clipping_threshold"),
    Hyperparameter("momentum", 0.0, "decay of an optional first moment (0: none, no state kept)", DECAY, was="adafactor_momentum"),
)


# lion


def _lion(train, schedule, logical, mask, layouts):
    del logical, layouts
    return optax.lion(schedule, b1=train.lion.b1, b2=train.lion.b2, weight_decay=train.weight_decay, mask=mask)


def _lion_state(train, shape, names):
    return (StateLeaf("mu", _all(shape)),)


LION_KEYS = (
    Hyperparameter("b1", 0.9, "interpolation of momentum and gradient whose sign is the update", DECAY, was="lion_b1"),
    Hyperparameter("b2", 0.99, "decay of the momentum", DECAY, was="lion_b2"),
)


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
            plan, beta=train.muon.beta, ns_steps=train.muon.ns_steps, nesterov=train.muon.nesterov,
            consistent_rms=train.muon.consistent_rms,
        ),
        optax.add_decayed_weights(train.weight_decay, mask),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": matrix_part, "adam": _adamw(train, schedule, logical, mask, None)}, labels)


def _muon_state(train, shape, names):
    return (StateLeaf("mu", _all(shape)),) if matrices.matrix_dims(names) is not None else _adam_state(train, shape, names)


def _muon_gathers(shape, names, spec, mesh_sizes):
    return matrices.gathered_bytes(shape, names, spec, mesh_sizes)


def _muon_flops(train, shape, names, spec, mesh_sizes):
    return matrices.newton_schulz_flops(shape, names, spec, mesh_sizes, train.muon.ns_steps)


MUON_KEYS = (
    Hyperparameter("beta", 0.95, "decay of the momentum that is orthogonalised", DECAY, was="muon_beta"),
    Hyperparameter("ns_steps", 5, "Newton–Schulz iterations per update", Range(1), was="muon_ns_steps"),
    Hyperparameter("nesterov", True, "orthogonalise the Nesterov momentum rather than the momentum", was="muon_nesterov"),
    Hyperparameter("consistent_rms", 0.2, "each matrix's update RMS (Moonlight's consistent RMS; 0: Keller Jordan's width scaling)",
                   NON_NEGATIVE, was="muon_consistent_rms"),
)


# sgd


def _sgd(train, schedule, logical, mask, layouts):
    del logical, layouts
    momentum = train.sgd.momentum or None
    return optax.chain(optax.add_decayed_weights(train.weight_decay, mask), optax.sgd(schedule, momentum, train.sgd.nesterov))


def _sgd_state(train, shape, names):
    return (StateLeaf("trace", _all(shape)),) if train.sgd.momentum > 0 else ()


SGD_KEYS = (
    Hyperparameter("momentum", 0.9, "decay of the momentum (0: none, no state kept)", DECAY, was="sgd_momentum"),
    Hyperparameter("nesterov", False, "Nesterov momentum", was="sgd_nesterov"),
)

OPTIMIZERS = (
    Optimizer("adamw", _adamw, ADAMW_KEYS, _adam_state),
    Optimizer("adafactor", _adafactor, ADAFACTOR_KEYS, _adafactor_state, _adafactor_checks),
    Optimizer("lion", _lion, LION_KEYS, _lion_state),
    Optimizer(
        "muon", _muon, MUON_KEYS, _muon_state, reads=("adamw",), gathers=_muon_gathers, update_flops=_muon_flops,
    ),
    Optimizer("sgd", _sgd, SGD_KEYS, _sgd_state),
)
OPTIMIZER_NAMES = tuple(o.name for o in OPTIMIZERS)


def optimizer(name: str) -> Optimizer:
    for record in OPTIMIZERS:
        if record.name == name:
            return record
    raise ValueError(f"train.optimizer={name!r} is not one of {OPTIMIZER_NAMES}")
