"""LoRA adapter dropout (`train.lora.dropout` > 0): PEFT's y = x·W + scale · (dropout(x)·A)·B.

A mask on the adapter's input cannot be folded into W + scale·A·B, so while training with dropout
the adapters run beside their matrices: `merge` builds the model with a `Side` module on every
adapted attention / MLP (`jaxpar.models.layers.Attention` and `MLP` add `Side.add` to each
projection), the base under stop_gradient. Evaluation and sampling pass no dropout key and keep the
folded path (`jaxpar.models.lora.fold`), as does every run with dropout 0 (bitwise unchanged).

The mask is a pure function of (step, matrix, layer, element index): the step key comes from the
train step (`step_key`), each stacked matrix's per-layer keys are folded from it before the layer
scan (`side_params`, so a layer's key travels with its slice of the params), and the mask is drawn
for the whole logical input [batch, seq, *in] with jax's partitionable threefry
(`jax_threefry_partitionable`, on by default), whose values do not depend on how the partitioner
shards the draw: the same mask on every mesh. That holds while the projections run on the global
batch in one pass (the PLAIN gradient path with train.grad_accum 1); microbatch splits (gradient
accumulation, the pipeline) would draw per microbatch and are refused (`problems`), as are matrices
outside Attention / MLP (experts — PEFT's ParamWrapper refuses lora_dropout too —, MLA's latents,
routers), which have no side path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import lora
from jaxpar.models.layers import MLP, Attention

SIDE = "lora_side"  # the attribute of an Attention / MLP that holds its adapters under dropout
KEY = "key"  # the Side's per-layer dropout key data
STEP_SEED = 0x10AD  # the step keys' root: masks depend on the step alone, like the data order


def rate(settings) -> float:
    """The adapters' dropout rate of `lora.settings(...)` (0: none)."""
    return 0.0 if settings is None else float(settings.get("dropout", 0.0))


def step_key(step):
    """The dropout key of train step `step` (an int32 array)."""
    return jax.random.fold_in(jax.random.key(STEP_SEED), step)


def training(opts, model_config, step):
    """`opts` for train step `step`: carrying its dropout key when the run drops adapter inputs."""
    if rate(lora.settings(model_config)) == 0:
        return opts
    return dataclasses.replace(opts, lora_dropout_key=step_key(step))


def _hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class DropoutKey(nnx.Variable):
    """Per-layer key data of a `Side` (uint32 [*stacked, 2]); not a parameter."""


class Side(nnx.Module):
    """One module's adapters run beside its matrices: `add(name, x, y)` = y + scale·(dropout(x)·A)·B."""

    def __init__(self, adapters: dict, key_shape: tuple, key_names: tuple, dropout: float, scale: float):
        """`adapters`: {matrix name: ((A shape, A names), (B shape, B names), dtype)}."""
        self.dropout, self.scale, self.names = dropout, scale, tuple(sorted(adapters))
        for name, (a, b, dtype) in adapters.items():
            setattr(self, name + lora.SUFFIXES[0], nnx.Param(jnp.zeros(a[0], dtype), out_sharding=a[1]))
            setattr(self, name + lora.SUFFIXES[1], nnx.Param(jnp.zeros(b[0], dtype), out_sharding=b[1]))
        self.key = DropoutKey(jnp.zeros(key_shape, jnp.uint32), out_sharding=key_names)

    def add(self, name: str, x, y, contract: int = 1):
        """`y` (x's projection by the matrix `name`) plus its adapter's output on dropped-out x;
        `contract`: x's trailing dims the matrix contracts (2 for attention's output)."""
        if name not in self.names:
            return y
        a, b = (getattr(self, name + s)[...] for s in lora.SUFFIXES)
        keep = keep_mask(jax.random.wrap_key_data(self.key[...]), name, x.shape, self.dropout)
        dropped = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        low = _contract(dropped, a, contract)
        return y + (self.scale * _contract(low, b, 1)).astype(y.dtype)


def _contract(x, w, contract: int):
    dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
    return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=x.dtype)


def keep_mask(layer_key, name: str, shape, dropout: float):
    """True where matrix `name`'s input is kept, for one layer's key: drawn for the whole logical shape."""
    return jax.random.bernoulli(jax.random.fold_in(layer_key, _hash(name)), 1.0 - dropout, shape)


def layer_keys(key, module_path: tuple, stacked: tuple):
    """Key data [*stacked, 2] of the module at `module_path` (e.g. ("layers", "attention")), one
    key per stacked index (layer), folded from the step key."""
    root = jax.random.fold_in(key, _hash("/".join(module_path)))
    keys = jax.vmap(lambda i: jax.random.fold_in(root, i))(jnp.arange(math.prod(stacked), dtype=jnp.uint32))
    return jax.random.key_data(keys).reshape(*stacked, -1)


def _groups(logical) -> dict:
    """{module path: {matrix name: (A names, B names)}} of the adapters in `logical`."""
    groups = {}
    for path, names in lora.adapter_names(logical).items():
        stem, suffix = path[-1][: -len(lora.SUFFIXES[0])], path[-1][-len(lora.SUFFIXES[0]) :]
        groups.setdefault(path[:-1], {}).setdefault(stem, {})[suffix] = names
    return groups


def _stacked(a_names) -> int:
    return lora.split_dims(a_names[:-1] + ("x",))[0]


def attach(module, shapes, logical, settings) -> list[str]:
    """Gives every adapted Attention / MLP of the (abstract) `module` its `Side`; returns the
    adapted matrices that are not in one (no side path: refused by `problems`)."""
    flat_shapes, missing = lora.adapters_of(shapes), []
    for module_path, matrices in _groups(logical).items():
        sub = module
        for key in module_path:
            sub = getattr(sub, key)
        if not isinstance(sub, (Attention, MLP)):
            missing += [".".join(module_path + (m,)) for m in matrices]
            continue
        adapters = {}
        for name, names in matrices.items():
            a, b = (flat_shapes[module_path + (name + s,)] for s in lora.SUFFIXES)
            adapters[name] = ((a.shape, names[lora.SUFFIXES[0]]), (b.shape, names[lora.SUFFIXES[1]]), a.dtype)
        a_names = next(iter(matrices.values()))[lora.SUFFIXES[0]]
        batch = _stacked(a_names)
        key_shape = next(iter(adapters.values()))[0][0][:batch] + (2,)
        make = functools.partial(Side, adapters, key_shape, a_names[:batch] + (None,), rate(settings), lora.scale(settings))
        with nnx.use_eager_sharding(False):  # placed by the rules table, like every parameter
            side = nnx.eval_shape(make)
        setattr(sub, SIDE, side)
    return missing


def side_params(params, logical, key):
    """`params` as the model with `Side`s reads them: the base under stop_gradient, each module's
    adapters moved into its `lora_side` with that module's per-layer dropout keys."""
    tree = jax.tree.map(jax.lax.stop_gradient, lora.base_of(params))
    flat = lora.adapters_of(params)
    for module_path, matrices in _groups(logical).items():
        side = {stem + s: flat[module_path + (stem + s,)] for stem in matrices for s in lora.SUFFIXES}
        a_names = next(iter(matrices.values()))[lora.SUFFIXES[0]]
        a = flat[module_path + (next(iter(matrices)) + lora.SUFFIXES[0],)]
        side[KEY] = layer_keys(key, module_path, a.shape[: _stacked(a_names)])
        holder = tree
        for k in module_path[:-1]:
            holder = holder[k]
        holder[module_path[-1]] = {**holder[module_path[-1]], SIDE: side}
    return tree


def problems(section, grad_accum: int, pipeline: int, misses) -> list[str]:
    """`train.lora.dropout`'s problems, one line each (none when it is 0); `misses()` gives the
    adapted matrices outside an Attention / MLP (`jaxpar.models.side_path_misses`)."""
    dropout = section.dropout
    if not (isinstance(dropout, (int, float)) and 0 < dropout < 1 and isinstance(section.rank, int) and section.rank > 0):
        return []  # off, or a bad value `lora.problems` reports
    errors = []
    if grad_accum != 1 or pipeline != 1:
        errors.append(
            f"train.lora.dropout={dropout} needs train.grad_accum=1 and no pipeline (has {grad_accum} and {pipeline} "
            "stages): its masks are drawn for the whole batch in one pass, the same on every mesh"
        )
    missing = misses()
    if missing:
        errors.append(
            f"train.lora.dropout={dropout}: {', '.join(missing)} have no side path for dropout (only attention's and "
            "dense MLPs' matrices; PEFT refuses dropout on expert parameters too); drop them from train.lora.targets"
        )
    return errors
