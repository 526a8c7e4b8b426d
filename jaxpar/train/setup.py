"""Turns a config into a mesh, shardings, and jitted init / train-step functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import fp8, models, objective, optim
from jaxpar.dtypes import DTYPES
from jaxpar.mesh import make_mesh
from jaxpar.models import lora
from jaxpar.models.options import RunOptions
from jaxpar.parallel.pipeline import order
from jaxpar.parallel.plan import ParallelPlan, make_plan
from jaxpar.sharding import Rules, is_logical_names, opt_state_rules, param_rules
from jaxpar.train.loss_scale import LossScale
from jaxpar.train.step import TrainState, make_train_step


@dataclass
class TrainProgram:
    """Everything a training loop (or a test) needs, built once per config."""

    config: Any
    mesh: Mesh
    plan: ParallelPlan
    rules: Rules  # parameters + activations
    opt_rules: Rules  # optimizer state
    opts: RunOptions
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[], TrainState]  # jitted; creates the state already sharded
    init_from_params: Callable  # jitted params (on the param shardings) -> TrainState with fresh optimizer state
    step: Callable  # jitted (state, batch) -> (state, metrics); donates state
    step_with_grads: Callable  # the same step also returning the gradients, in natural order (tests); compiled only if called
    # The state as the step keeps it <-> the natural [L] layer order (checkpoints, export, tests):
    # the identity unless the plan stores the layers in the schedule's order (`pipeline/order.py`).
    to_natural: Callable  # jitted TrainState -> TrainState
    to_storage: Callable  # jitted TrainState -> TrainState; donates its argument
    tx: optax.GradientTransformation
    schedule: Callable
    # The model config the program trains: config.model, carrying train.lora's adapters when on.
    model_config: Any = None


def model_config_of(config):
    """config.model, with `train.lora`'s adapter settings when its rank is > 0 (`jaxpar.models.lora`)
    and delayed FP8 scaling's history length (`jaxpar.fp8.with_state`)."""
    model = lora.adapted(config.model, config.train.lora) if "lora" in config.train else config.model
    return fp8.with_state(model, config.train)


def run_options(config, rules: Rules | None, plan: ParallelPlan) -> RunOptions:
    return RunOptions(
        rules=rules, plan=plan, compute_dtype=DTYPES[config.train.compute_dtype],
        # DPO's surrogate weights are no next-token weights the multi-token modules could reuse.
        mtp_loss_weight=0.0 if objective.settings(config.train) else float(config.train.mtp_loss_weight),
        fp8=fp8.from_config(config.train),
    )


def build(config, devices=None) -> TrainProgram:
    mesh = make_mesh(config.mesh, devices)
    plan = make_plan(config, dict(mesh.shape), models.facts(config.model), mesh.devices.flat[0].platform)
    rules, opt_rules = param_rules(plan, mesh), opt_state_rules(plan, mesh)
    model_config = model_config_of(config)
    adapting = lora.settings(model_config) is not None
    preference = objective.settings(config.train)
    # DPO's reference model: with LoRA the base itself, else a frozen copy of the starting params.
    full_reference = preference is not None and not adapting
    logical = models.logical_axes(model_config)
    param_dtype = DTYPES[config.train.param_dtype]
    # LoRA's frozen base may be held in the compute dtype (train.lora.base_in_compute_dtype): the
    # forward casts it there anyway, and nothing updates it.
    base_dtype = DTYPES[config.train.compute_dtype] if adapting and config.train.lora.get("base_in_compute_dtype") else param_dtype
    dtypes = jax.tree_util.tree_map_with_path(lambda p, _: param_dtype if lora.is_adapter(p) else base_dtype, logical,
                                              is_leaf=is_logical_names)
    params_shape = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, d), models.param_shapes(model_config), dtypes)

    param_shardings = rules.tree_shardings(logical)
    opt_param_shardings = opt_rules.tree_shardings(logical)
    tx, schedule = optim.make_optimizer(config.train, logical, opt_param_shardings)
    if adapting:  # the frozen base: no optimizer state, no update (the step keeps it as it was)
        tx = optax.masked(tx, lora.adapter_mask(logical, is_leaf=is_logical_names))
    replicated = NamedSharding(mesh, P())
    loss_scale = LossScale.create(
        dynamic=config.train.compute_dtype == "float16",
        initial_scale=config.train.loss_scale_init,
        period=config.train.loss_scale_period,
    )
    state_shardings = TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=optim.state_shardings(
            optim.optimizer(config.train.optimizer), config.train, tx, params_shape, logical, opt_param_shardings, mesh
        ),
        loss_scale=jax.tree.map(lambda _: replicated, loss_scale),
        reference=param_shardings if full_reference else None,
    )
    seed = config.train.seed
    # Each leaf's axis over the stacked layers (-1: none), for the storage order (`pipeline/order.py`).
    axes = TrainState(
        step=order.NO_AXIS,
        params=jax.tree.map(lambda n: n.index("layers") if "layers" in n else order.NO_AXIS, logical, is_leaf=is_logical_names),
        opt_state=optim.state_axes(
            optim.optimizer(config.train.optimizer), config.train, tx, params_shape, logical, "layers", order.NO_AXIS
        ),
        loss_scale=jax.tree.map(lambda _: order.NO_AXIS, loss_scale),
    )
    axes = axes.replace(reference=axes.params if full_reference else None)
    permute = lambda to, tree, part: to(tree, part, plan.pipeline, mesh)  # noqa: E731
    reordered = plan.pipeline is not None and plan.pipeline.stored_order is not None

    def state_from_params(params):
        """Natural-order params -> the state in storage order (the optimizer state built on it).
        With LoRA, base params alone get fresh adapters (a transformers checkpoint's weights)."""
        if adapting and not lora.adapters_of(params):
            params = lora.with_init(params, lora.base_of(logical), lora.settings(model_config), seed)
        params = permute(order.to_storage, jax.tree.map(lambda p, d: p.astype(d), params, dtypes), axes.params)
        reference = jax.tree.map(jnp.copy, params) if full_reference else None
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), loss_scale=loss_scale,
                          reference=reference)

    def init_state():
        return state_from_params(models.init_params(model_config, seed))

    opts = run_options(config, rules, plan)
    train_step = make_train_step(model_config, tx, schedule, opts, opt_param_shardings, dpo=preference)
    batch_sharding = rules.sharding(("batch", None))
    return TrainProgram(
        config=config,
        mesh=mesh,
        plan=plan,
        rules=rules,
        opt_rules=opt_rules,
        opts=opts,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        init=jax.jit(init_state, out_shardings=state_shardings),
        init_from_params=jax.jit(
            state_from_params, in_shardings=None if adapting else (param_shardings,), out_shardings=state_shardings
        ),
        step=jax.jit(
            lambda state, batch: train_step(state, batch)[:2],
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ),
        step_with_grads=jax.jit(
            lambda state, batch: _natural_grads(train_step(state, batch), permute, axes.params),
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated, opt_param_shardings),
            donate_argnums=0,
        ),
        to_natural=jax.jit(lambda state: permute(order.to_natural, state, axes), out_shardings=state_shardings)
        if reordered else _same,
        to_storage=jax.jit(
            lambda state: permute(order.to_storage, state, axes), out_shardings=state_shardings, donate_argnums=0
        ) if reordered else _same,
        tx=tx,
        schedule=schedule,
        model_config=model_config,
    )


def _same(state):
    return state


def _natural_grads(result, permute, axes):
    state, metrics, grads = result
    return state, metrics, permute(order.to_natural, grads, axes)


def bytes_per_device(tree, shardings) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `shardings`."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total
