"""The jitted training step: gradient accumulation, loss scaling, clipping, AdamW.

Everything here is written for the global (SPMD) view; where arrays live is decided only by the
shardings built in `jaxpar.train.setup` from the rules table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxpar import models
from jaxpar.models.layers import RunOptions
from jaxpar.sharding import constrain
from jaxpar.train.loss import mean_cross_entropy
from jaxpar.train.loss_scale import LossScale, all_finite

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale


def split_microbatches(batch, accum: int, rules):
    """[G, S+1] → [accum, G/accum, S+1] with microbatch m = rows j*accum + m, so every
    data-parallel shard keeps its own rows: no data moves between devices."""
    rows, width = batch.shape
    micro = batch.reshape(rows // accum, accum, width).swapaxes(0, 1)
    return constrain(rules, micro, (None, "batch", None))


def loss_and_grads(params, batch, *, model_config, opts: RunOptions, accum: int = 1, scale=1.0):
    """(loss, grads, model metrics): mean next-token loss over the global batch plus any model
    auxiliary loss, its fp32 gradient (unscaled), and the model's own metrics."""
    if opts.pipeline is not None:  # mesh.pipeline > 1: the schedule engine, microbatches inside
        from jaxpar.parallel.pipeline import pipelined_loss_and_grads  # late: it imports this module

        return pipelined_loss_and_grads(params, batch, model_config=model_config, opts=opts, accum=accum, scale=scale)
    replicas = 1 if opts.rules is None else opts.rules.mesh.shape["data"]
    # Per-replica accumulation would compute MoE load-balancing statistics per data replica,
    # making them depend on mesh.data; MoE models accumulate the plain way instead.
    if accum > 1 and replicas > 1 and opts.gathered_rules is None and not models.has_aux_losses(model_config):
        return _per_replica_accumulation(params, batch, replicas, model_config=model_config, opts=opts, accum=accum, scale=scale)
    return _accumulate(params, batch, model_config=model_config, opts=opts, accum=accum, scale=scale)


def _accumulate(params, batch, *, model_config, opts: RunOptions, accum: int, scale):
    def scaled_loss(p, tokens):
        logits, aux = models.apply(model_config, p, tokens[:, :-1], opts)
        cross_entropy = mean_cross_entropy(logits, tokens[:, 1:])
        extra, metrics = models.aux_losses(model_config, aux)
        loss = cross_entropy + extra
        return loss * scale, (loss, metrics)

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
    if accum == 1:
        (_, (loss, metrics)), grads = grad_fn(params, batch)
    else:
        # MoE auxiliary losses are computed per microbatch here (as Megatron and transformers do).
        def micro_step(carry, tokens):
            (_, (loss, metrics)), grads = grad_fn(params, tokens)
            return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

        shapes = jax.eval_shape(lambda: grad_fn(params, batch[: batch.shape[0] // accum]))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (shapes[0][1][0], shapes[0][1][1], shapes[1]))
        micro = split_microbatches(batch, accum, opts.rules)
        totals, _ = jax.lax.scan(micro_step, zeros, micro)
        loss, metrics, grads = jax.tree.map(lambda t: t / accum, totals)
    grads = jax.tree.map(lambda g: (g / scale).astype(jnp.float32), grads)
    return loss, grads, metrics


def _per_replica_accumulation(params, batch, replicas: int, **kwargs):
    """Gradient accumulation with one data-parallel reduction per step.

    Accumulating replicated gradients would make the partitioner all-reduce them in every
    micro-step. Instead each data replica accumulates its own gradient — a leading [data] axis,
    sharded over `data`, via vmap's spmd_axis_name — and one mean over that axis reduces them.
    (ZeRO-3 keeps per-micro-step reduce-scatters, as FSDP does, to keep gradients sharded.)
    """
    opts = kwargs.pop("opts")
    inner = dataclasses.replace(opts, rules=opts.rules.without("data"))
    rows, width = batch.shape
    # Replica d holds rows [d·G/R, (d+1)·G/R): exactly the rows the data-major batch sharding gives it.
    split = batch.reshape(replicas, rows // replicas, width)
    per_replica = jax.vmap(
        lambda p, b: _accumulate(p, b, opts=inner, **kwargs), in_axes=(None, 0), spmd_axis_name="data"
    )(params, split)
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), per_replica)


def make_train_step(config, tx, schedule, opts: RunOptions, grad_shardings=None):
    """(state, batch [G, S+1] int32) → (state, metrics)."""
    model_config, accum = config.model, config.train.grad_accum

    def train_step(state: TrainState, batch):
        loss, grads, model_metrics = loss_and_grads(
            state.params, batch, model_config=model_config, opts=opts, accum=accum, scale=state.loss_scale.scale
        )
        if grad_shardings is not None:
            # ZeRO ≥ 1: gradients reduce-scattered to the optimizer-state layout.
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = all_finite(grads) if state.loss_scale.dynamic else jnp.asarray(True)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            loss_scale=state.loss_scale.update(finite),
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": schedule(state.step),
            "loss_scale": state.loss_scale.scale,
            "skipped_steps": new_state.loss_scale.skipped_steps,
            **model_metrics,
        }
        return new_state, metrics

    return train_step
