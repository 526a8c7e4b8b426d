"""The functional face of the NNX models.

Parameters travel as plain nested dicts of arrays (`params`); `logical_axes(cfg)` gives the same
tree with a tuple of logical names per leaf. `apply` merges params into the module inside the
traced function, so `jax.jit` / `jax.shard_map` only ever see plain arrays. Which module a
`config.model` builds, and its auxiliary losses, come from its family record
(`jaxpar.models.families`). Leaves that are model state rather than trained parameters (e.g. the
loss-free router bias) are named by `jaxpar.models.state`; `take_observations` / `update_state`
are the train step's two calls for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import FrozenConfigDict

from jaxpar.model_facts import padded_vocab_size
from jaxpar.models import lora as lora_adapters
from jaxpar.models import lora_dropout
from jaxpar.models import state as model_state
from jaxpar.models.families import facts, family
from jaxpar.models.options import RunOptions


def frozen(model_config) -> FrozenConfigDict:
    return model_config if isinstance(model_config, FrozenConfigDict) else FrozenConfigDict(model_config)


def _build(cfg: FrozenConfigDict, seed: int):
    # Parameters are created unsharded and placed by jit out_shardings from our own rules table,
    # so Flax must not shard them eagerly at creation from their logical names.
    with nnx.use_eager_sharding(False):
        return family(cfg.model_type).module(cfg, rngs=nnx.Rngs(params=seed))


@functools.lru_cache(maxsize=32)
def _abstract(cfg: FrozenConfigDict):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _build(cfg, 0)))
    return graphdef, state


def graphdef(model_config):
    return _abstract(frozen(model_config))[0]


def _base_shapes(cfg):
    return nnx.to_pure_dict(_abstract(cfg)[1])


def _base_logical(cfg):
    specs = nnx.to_pure_dict(nnx.get_partition_spec(_abstract(cfg)[1]))
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def param_shapes(model_config):
    """ShapeDtypeStructs of the params tree (LoRA adapters included: `jaxpar.models.lora`), without allocating."""
    cfg = frozen(model_config)
    if (lora := lora_adapters.settings(cfg)) is None:
        return _base_shapes(cfg)
    return lora_adapters.with_shapes(_base_shapes(cfg), _base_logical(cfg), lora)


def logical_axes(model_config):
    """The params tree with a tuple of logical axis names at each leaf."""
    cfg = frozen(model_config)
    if (lora := lora_adapters.settings(cfg)) is None:
        return _base_logical(cfg)
    return lora_adapters.with_logical(_base_shapes(cfg), _base_logical(cfg), lora)


def init_params(model_config, seed: int):
    """Initial params as a pure function of (config, seed): call under jit with out_shardings to
    create them directly sharded; the values never depend on the mesh."""
    cfg = frozen(model_config)
    params = nnx.to_pure_dict(nnx.split(_build(cfg, seed))[1])
    if (lora := lora_adapters.settings(cfg)) is None:
        return params
    return lora_adapters.with_init(params, _base_logical(cfg), lora, seed)


@functools.lru_cache(maxsize=8)
def _side_abstract(cfg: FrozenConfigDict):
    """(graphdef of the model with its adapters beside their matrices, the matrices left without one)."""
    module = nnx.eval_shape(lambda: _build(cfg, 0))
    missing = lora_dropout.attach(module, param_shapes(cfg), logical_axes(cfg), lora_adapters.settings(cfg))
    return nnx.split(module)[0], tuple(missing)


def side_path_misses(model_config) -> tuple[str, ...]:
    """The adapted matrices that adapter dropout cannot reach (`jaxpar.models.lora_dropout`)."""
    return _side_abstract(frozen(model_config))[1]


def merge(model_config, params, dropout_key=None):
    """The model module holding `params` (inside a traced function: a view, not a copy); LoRA
    adapters folded into their matrices, the base frozen (`jaxpar.models.lora.fold`), or with a
    `dropout_key` (training with `train.lora.dropout` > 0) run beside them on dropped-out inputs."""
    cfg = frozen(model_config)
    if (lora := lora_adapters.settings(cfg)) is not None:
        if dropout_key is not None and lora_dropout.rate(lora) > 0:
            return nnx.merge(_side_abstract(cfg)[0], lora_dropout.side_params(params, logical_axes(cfg), dropout_key))
        params = lora_adapters.fold(params, lora, logical_axes(cfg))
    return nnx.merge(graphdef(cfg), params)


def apply(model_config, params, tokens, opts: RunOptions = RunOptions(), positions=None, segment_ids=None, ahead=None):
    """(logits, aux) for int tokens [B, S]: fp32 logits [B, S, padded vocab] with padded columns
    masked, and the model's auxiliary per-layer outputs (see `aux_losses`). `positions` [B, S]
    default to 0 .. S-1; `segment_ids` [B, S] (packed documents, 0 padding) default to one
    sequence per row. `ahead` [D, B, S] (D = `prediction_depth`, tokens i + 1 .. i + D of each
    position i): also run the multi-token prediction modules, whose logits come back in
    aux["ahead_logits"] [D, B, S, padded vocab] (`jaxpar.models.decoder.Decoder.__call__`)."""
    # Model state keeps its stored dtype (its observations are exact; `jaxpar.models.state`).
    mask = model_state.state_mask(params, _abstract(frozen(model_config))[1])
    params = jax.tree.map(lambda p, kept: p if kept else p.astype(opts.compute_dtype), params, mask)
    module = merge(model_config, params, opts.lora_dropout_key)
    if ahead is None:
        return module(tokens, opts, positions, segment_ids)
    return module(tokens, opts, positions, segment_ids, ahead=ahead)


def prediction_depth(model_config) -> int:
    """Tokens ahead the model's multi-token prediction modules predict (0: it has none)."""
    return family(model_config.model_type).module.prediction_depth(model_config)


def take_observations(model_config, grads):
    """(grads with the model-state leaves zeroed, their observations): see `jaxpar.models.state`."""
    return model_state.take_observations(grads, _abstract(frozen(model_config))[1])


def update_state(model_config, params, previous, observations):
    """`params` with each model-state leaf set by its own rule from `previous` and its observation."""
    return model_state.update_state(params, previous, observations, _abstract(frozen(model_config))[1])


def aux_losses(model_config, aux) -> tuple[jnp.ndarray, dict]:
    """(extra loss to add to the cross-entropy, metrics) from `apply`'s aux; zero for dense models."""
    losses = family(model_config.model_type).aux_losses
    if losses is None:
        return jnp.zeros((), jnp.float32), {}
    return losses(frozen(model_config), aux)


def forward(model_config, params, tokens) -> jnp.ndarray:
    """float32 logits [B, S, vocab_size] on one device, no mesh needed."""
    logits = jax.jit(lambda p, t: apply(model_config, p, t)[0])(params, jnp.asarray(tokens))
    return logits[..., : model_config.vocab_size]


__all__ = [
    "RunOptions",
    "facts",
    "family",
    "apply",
    "aux_losses",
    "forward",
    "init_params",
    "logical_axes",
    "merge",
    "padded_vocab_size",
    "param_shapes",
    "prediction_depth",
    "take_observations",
    "update_state",
]
