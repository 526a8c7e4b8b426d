"""The training loss: mean next-token cross-entropy plus the family's auxiliary losses, and the
multi-token prediction loss of models with such modules (`train.mtp_loss_weight` times the mean of
its depths' losses, each depth's in the metrics as `mtp_loss` [D])."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar import models
from jaxpar.parallel.context.sequence import Ahead, TokenBatch, split_ahead, split_rows
from jaxpar.parallel.tensor import mean_cross_entropy


def token_loss(params, batch: TokenBatch, rules, *, model_config, opts, scale, ahead: Ahead | None = None):
    """(loss · scale, (loss, model metrics)) for a `TokenBatch` [B, S] (positions None: 0 .. S-1),
    run with `rules` (the gradient paths may drop axes from the run options' rules); with `ahead`
    (`jaxpar.parallel.context.sequence.Ahead`) the multi-token prediction loss too."""
    opts = dataclasses.replace(opts, rules=rules)
    logits, aux = models.apply(
        model_config, params, batch.tokens, opts, batch.positions, batch.segment_ids,
        ahead=None if ahead is None else ahead.tokens,
    )
    with jax.named_scope("loss"):
        ahead_logits = aux.pop("ahead_logits", None)
        extra, metrics = models.aux_losses(model_config, aux)
        loss = mean_cross_entropy(logits, batch.targets, batch.weights) + extra
        if ahead is not None:
            depths = jnp.stack([
                mean_cross_entropy(ahead_logits[k], ahead.targets[k], ahead.weights[k]) for k in range(ahead.tokens.shape[0])
            ])
            loss = loss + opts.mtp_loss_weight * jnp.mean(depths)
            metrics = {**metrics, "mtp_loss": depths}
    return loss * scale, (loss, metrics)


def prediction_depth(model_config, opts) -> int:
    """Depths of multi-token prediction the training loss runs (0: none)."""
    return models.prediction_depth(model_config) if opts.mtp_loss_weight > 0 else 0


def model_loss(params, rows, rules, *, model_config, opts, scale):
    """`token_loss` for token rows [B, S+1] (inputs and shifted targets; or a
    `document_batch` dict): with context parallelism in the order the sequence is sharded (load
    balancing), positions true."""
    batch = split_rows(rows, opts.plan.context, rules)
    depth = prediction_depth(model_config, opts)
    ahead = split_ahead(rows, depth, opts.plan.context, rules) if depth else None
    return token_loss(params, batch, rules, model_config=model_config, opts=opts, scale=scale, ahead=ahead)
