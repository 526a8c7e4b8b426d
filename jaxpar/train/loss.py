"""The training loss: mean next-token cross-entropy plus the family's auxiliary losses."""

from __future__ import annotations

import dataclasses

import jax

from jaxpar import models
from jaxpar.parallel.context.sequence import TokenBatch, split_rows
from jaxpar.parallel.tensor import mean_cross_entropy


def token_loss(params, batch: TokenBatch, rules, *, model_config, opts, scale):
    """(loss · scale, (loss, model metrics)) for a `TokenBatch` [B, S] (positions None: 0 .. S-1),
    run with `rules` (the gradient paths may drop axes from the run options' rules)."""
    opts = dataclasses.replace(opts, rules=rules)
    logits, aux = models.apply(model_config, params, batch.tokens, opts, batch.positions, batch.segment_ids)
    with jax.named_scope("loss"):
        extra, metrics = models.aux_losses(model_config, aux)
        loss = mean_cross_entropy(logits, batch.targets, batch.weights) + extra
    return loss * scale, (loss, metrics)


def model_loss(params, rows, rules, *, model_config, opts, scale):
    """`token_loss` for token rows [B, S+1] (inputs and shifted targets; or a
    `document_batch` dict): with context parallelism in the order the sequence is sharded (load
    balancing), positions true."""
    batch = split_rows(rows, opts.plan.context, rules)
    return token_loss(params, batch, rules, model_config=model_config, opts=opts, scale=scale)
