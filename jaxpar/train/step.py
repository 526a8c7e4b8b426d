"""The jitted training step: gradients by the plan's strategy, loss scaling, clipping, the optimizer (`jaxpar.optim`).

Everything here is written for the global (SPMD) view; where arrays live is decided only by the
shardings built in `jaxpar.train.setup` from the rules table.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar import models
from jaxpar.models import lora, lora_dropout
from jaxpar.models.options import RunOptions
from jaxpar.parallel import data
from jaxpar.parallel.context.accumulation import per_rank_grads
from jaxpar.parallel.context.sequence import document_batch
from jaxpar.parallel.data import GradientStrategy
from jaxpar.parallel.pipeline.engine import pipelined_loss_and_grads, pipelined_target_logps
from jaxpar.parallel.pipeline.stage import StageModel
from jaxpar.parallel.zero import constrain_grads
from jaxpar.train import dpo as dpo_objective
from jaxpar.train.loss import model_loss, token_loss
from jaxpar.train.loss_scale import LossScale, all_finite

_FIELDS = ("step", "params", "opt_state", "loss_scale")


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale
    # train.objective dpo without LoRA: the frozen reference model (the starting params); else None.
    # Without one the pytree has exactly the four fields it always had, so checkpoints saved before
    # the field existed restore (Orbax compares tree structures, and a None node is one).
    reference: Any = None

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)

    def tree_flatten_with_keys(self):
        names = _FIELDS + (("reference",) if self.reference is not None else ())
        children = (self.step, self.params, self.opt_state, self.loss_scale, self.reference)[: len(names)]
        return [(jax.tree_util.GetAttrKey(n), c) for n, c in zip(names, children)], len(names) > len(_FIELDS)

    @classmethod
    def tree_unflatten(cls, has_reference, children):
        return cls(*children) if has_reference else cls(*children, reference=None)


def stage_model(model_config) -> StageModel:
    """The model as the pipeline engine sees it (`jaxpar.parallel` does not import the models)."""
    cfg = models.frozen(model_config)
    module = models.family(cfg.model_type).module
    return StageModel(
        merge=functools.partial(models.merge, cfg),
        logical=models.logical_axes(cfg),
        aux_losses=functools.partial(models.aux_losses, cfg),
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        embed_scale=module.embedding_scale(cfg),
        logit_softcap=module.final_logit_softcap(cfg),
    )


def loss_and_grads(params, batch, *, model_config, opts: RunOptions, scale=1.0):
    """(loss, grads, model metrics): mean next-token loss over the global batch's real targets
    (token rows [G, S+1], or packed documents [G, 2, S+1]) plus any model auxiliary loss, its fp32
    gradient (unscaled), and the model's own metrics — by the gradient strategy the plan chose
    (`jaxpar.parallel.data.GradientStrategy`)."""
    batch = document_batch(batch)  # target weights from the whole global batch, before any split
    strategy = opts.plan.gradient
    if strategy is GradientStrategy.PIPELINED:
        return pipelined_loss_and_grads(params, batch, model=stage_model(model_config), opts=opts, scale=scale)
    if strategy is GradientStrategy.PER_RANK:
        return per_rank_grads(
            functools.partial(token_loss, model_config=model_config, opts=opts), params, batch,
            accum=opts.plan.grad_accum, rules=opts.rules, plan=opts.plan, scale=scale,
            param_names=models.logical_axes(model_config),
        )
    loss_fn = functools.partial(model_loss, model_config=model_config, opts=opts, scale=scale)
    accumulate = data.per_replica_grads if strategy is GradientStrategy.PER_REPLICA else data.accumulated_grads
    return accumulate(loss_fn, params, batch, accum=opts.plan.grad_accum, rules=opts.rules, scale=scale)


def dpo_loss_and_grads(state: TrainState, batch, *, model_config, opts: RunOptions, dpo, scale=1.0):
    """(DPO loss, its gradient, metrics) of a preference batch [G, 3, S+1] (`jaxpar.train.dpo`): the
    reference is `state.reference`, or with LoRA the params without their adapters."""
    if state.reference is not None:
        reference, reference_config = state.reference, model_config
    else:
        reference, reference_config = lora.base_of(state.params), lora.base_config(model_config)
    logps = dpo_objective.target_logps
    if opts.plan.gradient is GradientStrategy.PIPELINED:
        logps = lambda p, rows, model_config, opts: pipelined_target_logps(p, rows, model=stage_model(model_config), opts=opts)  # noqa: E731
    loss, metrics, surrogate = dpo_objective.dpo_pass(
        state.params, reference, batch, model_config=model_config, reference_config=reference_config, opts=opts, dpo=dpo,
        logps=logps,
    )
    _, grads, model_metrics = loss_and_grads(state.params, surrogate, model_config=model_config, opts=opts, scale=scale)
    return loss, grads, {**model_metrics, **metrics}


def make_train_step(model_config, tx, schedule, opts: RunOptions, opt_param_shardings, dpo=None):
    """(state, batch [G, S+1] or [G, 2, S+1] int32) → (state, metrics, grads). The jitted production step
    (`jaxpar.train.setup`) drops the gradients; tests keep them to compare with one device. `dpo`
    (`jaxpar.train.dpo.Dpo`): the step minimises the DPO loss of preference batches [G, 3, S+1]."""

    def train_step(state: TrainState, batch):
        step_opts = lora_dropout.training(opts, model_config, state.step)  # LoRA dropout: this step's key
        if dpo is None:
            loss, grads, model_metrics = loss_and_grads(
                state.params, batch, model_config=model_config, opts=step_opts, scale=state.loss_scale.scale
            )
        else:
            loss, grads, model_metrics = dpo_loss_and_grads(
                state, batch, model_config=model_config, opts=step_opts, dpo=dpo, scale=state.loss_scale.scale
            )
        # Model state (e.g. the loss-free router bias) is not trained: its gradient slot carries
        # what the forward observed, taken out before clipping (`jaxpar.models.state`).
        grads, observations = models.take_observations(model_config, grads)
        if lora.settings(model_config) is not None:
            # The base is frozen: the model's forward stops its gradients, but the pipeline runs the
            # embedding and LM head outside the model's merge; their gradients are dropped here.
            grads = jax.tree_util.tree_map_with_path(lambda p, g: g if lora.is_adapter(p) else jnp.zeros_like(g), grads)
        grads = constrain_grads(grads, opt_param_shardings, opts.plan.zero)
        with jax.named_scope("optimizer_update"):
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            params = models.update_state(model_config, params, state.params, observations)
            if lora.settings(model_config) is not None:  # the frozen base stays bitwise as it was
                params = jax.tree_util.tree_map_with_path(
                    lambda p, new, old: new if lora.is_adapter(p) else old, params, state.params
                )
            # One global verdict, inside the step (no extra host sync): a non-finite step leaves params
            # and optimizer state as they were and is counted; the loop's policy decides what next
            # (jaxpar.train.nonfinite). fp16 checks every gradient (overflow); otherwise the loss and
            # the norm, already computed, cover every gradient element.
            finite = jnp.isfinite(loss) & (all_finite(grads) if state.loss_scale.dynamic else jnp.isfinite(grad_norm))
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            new_state = TrainState(
                step=state.step + finite.astype(jnp.int32),
                params=keep(params, state.params),
                opt_state=keep(opt_state, state.opt_state),
                loss_scale=state.loss_scale.update(finite),
                reference=state.reference,
            )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": schedule(state.step),
            "loss_scale": state.loss_scale.scale,
            "skipped_steps": new_state.loss_scale.skipped_steps,
            **model_metrics,
        }
        return new_state, metrics, grads

    return train_step
