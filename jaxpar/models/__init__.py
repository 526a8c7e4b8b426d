"""Model registry and the functional face of the NNX models.

Parameters travel as plain nested dicts of arrays (`params`); `logical_axes(cfg)` gives the same
tree with a tuple of logical names per leaf. `apply` merges params into the module inside the
traced function, so `jax.jit` / `jax.shard_map` only ever see plain arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict, FrozenConfigDict

from jaxpar.models.layers import RunOptions, padded_vocab_size
from jaxpar.models.llama import Llama

# Parameters are created unsharded and placed by jit out_shardings from our own rules table, so
# Flax must not try to shard them eagerly at creation from their logical names.
nnx.use_eager_sharding(False)

MODEL_CLASSES = {"llama": Llama}


def register(model_type: str, cls) -> None:
    MODEL_CLASSES[model_type] = cls


def frozen(model_config) -> FrozenConfigDict:
    return model_config if isinstance(model_config, FrozenConfigDict) else FrozenConfigDict(model_config)


def _build(cfg: FrozenConfigDict, seed: int):
    if cfg.model_type not in MODEL_CLASSES:
        raise ValueError(f"model.model_type={cfg.model_type!r} is not one of {sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[cfg.model_type](cfg, rngs=nnx.Rngs(params=seed))


@functools.lru_cache(maxsize=32)
def _abstract(cfg: FrozenConfigDict):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _build(cfg, 0)))
    return graphdef, state


def graphdef(model_config):
    return _abstract(frozen(model_config))[0]


def param_shapes(model_config):
    """ShapeDtypeStructs of the params tree, without allocating."""
    return nnx.to_pure_dict(_abstract(frozen(model_config))[1])


def logical_axes(model_config):
    """The params tree with a tuple of logical axis names at each leaf."""
    state = _abstract(frozen(model_config))[1]
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def init_params(model_config, seed: int):
    """Initial params as a pure function of (config, seed): call under jit with out_shardings to
    create them directly sharded; the values never depend on the mesh."""
    cfg = frozen(model_config)
    return nnx.to_pure_dict(nnx.split(_build(cfg, seed))[1])


def apply(model_config, params, tokens, opts: RunOptions = RunOptions()):
    """(logits, aux) for int tokens [B, S]: fp32 logits [B, S, padded vocab] with padded columns
    masked, and the model's auxiliary per-layer outputs (see `aux_losses`)."""
    cfg = frozen(model_config)
    params = jax.tree.map(lambda p: p.astype(opts.compute_dtype), params)
    model = nnx.merge(graphdef(cfg), params)
    return model(tokens, opts)


def has_aux_losses(model_config) -> bool:
    """Whether the model adds batch-statistics losses (MoE load balancing) to the cross-entropy."""
    return hasattr(MODEL_CLASSES[model_config.model_type], "aux_losses")


def aux_losses(model_config, aux) -> tuple[jnp.ndarray, dict]:
    """(extra loss to add to cross-entropy, metrics) from `apply`'s aux; zero for dense models."""
    cls = MODEL_CLASSES[model_config.model_type]
    if hasattr(cls, "aux_losses"):
        return cls.aux_losses(frozen(model_config), aux)
    return jnp.zeros((), jnp.float32), {}


def forward(model_config, params, tokens) -> jnp.ndarray:
    """float32 logits [B, S, vocab_size] on one device, no mesh needed."""
    logits = jax.jit(lambda p, t: apply(model_config, p, t)[0])(params, jnp.asarray(tokens))
    return logits[..., : model_config.vocab_size]


__all__ = [
    "ConfigDict",
    "RunOptions",
    "apply",
    "forward",
    "init_params",
    "logical_axes",
    "padded_vocab_size",
    "param_shapes",
    "register",
]

# Model families beyond Llama register themselves on import.
from jaxpar.models import mixtral as _mixtral  # noqa: E402,F401
