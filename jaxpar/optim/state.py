"""Where every optimizer-state leaf lives, and what it costs, from the optimizer's record.

A state leaf that belongs to a parameter sits under that parameter's key path (the trailing dict
keys of its path), below an optax state attribute (`mu`, `v_row`, ...). The record's `state`
(`jaxpar.optim.optimizers.StateLeaf`) says which of the parameter's dims the leaf spans; its
sharding is the parameter's optimizer-state sharding (ZeRO's `data` split included) restricted to
those dims, so a factored moment keeps the shards of the dims it keeps rather than being
replicated. Leaves of no parameter (step counts) are replicated. A leaf the record does not
describe, or describes with another shape, raises: the record and optax must agree.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, GetAttrKey

from jaxpar.sharding import is_logical_names


class StateLayoutError(ValueError):
    """The optimizer record and the optimizer's actual state disagree."""


def _param_path(path) -> tuple[tuple, str | None]:
    """(the trailing dict keys, the attribute name just before them)."""
    i = len(path)
    while i > 0 and isinstance(path[i - 1], DictKey):
        i -= 1
    field = path[i - 1].name if i > 0 and isinstance(path[i - 1], GetAttrKey) else None
    return tuple(k.key for k in path[i:]), field


def _by_path(tree, is_leaf=None) -> dict:
    return {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _entries(spec: P, ndim: int) -> list:
    return list(spec) + [None] * (ndim - len(spec))


def state_shardings(record, train, tx, params_shape, logical, param_state_shardings, mesh):
    """NamedShardings for `tx`'s state (the tree `tx.init(params)` returns, without allocating it)."""
    abstract = jax.eval_shape(tx.init, params_shape)
    shapes, names = _by_path(params_shape), _by_path(logical, is_leaf=is_logical_names)
    shardings = _by_path(param_state_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        key, field = _param_path(path)
        if key not in shapes:
            return replicated
        shape = shapes[key].shape
        layout = {s.field: s for s in record.state(train, shape, names[key])}
        where = f"{record.name} state {jax.tree_util.keystr(path)} of a {shape} parameter"
        if field not in layout:
            raise StateLayoutError(f"{where}: field {field!r} is not in the record ({sorted(layout)})")
        if layout[field].shape(shape) != leaf.shape:
            raise StateLayoutError(f"{where}: shape {leaf.shape}, the record says {layout[field].shape(shape)}")
        spec = _entries(shardings[key].spec, len(shape))
        return NamedSharding(mesh, P(*[None if d is None else spec[d] for d in layout[field].dims]))

    return jax.tree_util.tree_map_with_path(place, abstract)


def tree_state_bytes(record, train, params_shape, logical) -> int:
    """Unsharded optimizer-state bytes of a whole params tree (shapes and dtypes from `params_shape`)."""
    names = _by_path(logical, is_leaf=is_logical_names)
    return sum(record.state_bytes(train, x.shape, names[k], x.dtype) for k, x in _by_path(params_shape).items())


def state_axes(record, train, tx, params_shape, logical, name: str, none: int = -1):
    """For each leaf of `tx`'s state: the axis of the leaf that spans the parameter dim with logical
    name `name` (e.g. the stacked layers), or `none` (the leaf has no such axis, or belongs to no
    parameter)."""
    abstract = jax.eval_shape(tx.init, params_shape)
    shapes, names = _by_path(params_shape), _by_path(logical, is_leaf=is_logical_names)

    def axis(path, leaf):
        key, field = _param_path(path)
        if key not in shapes or name not in names[key]:
            return none
        layout = {s.field: s for s in record.state(train, shapes[key].shape, names[key])}
        dims = layout[field].dims if field in layout else ()
        return next((k for k, d in enumerate(dims) if d is not None and names[key][d] == name), none)

    return jax.tree_util.tree_map_with_path(axis, abstract)
