"""The training loss: mean next-token cross-entropy plus the family's auxiliary losses."""

from __future__ import annotations

import dataclasses

import jax

from jaxpar import models
from jaxpar.parallel.tensor import mean_cross_entropy


def model_loss(params, rows, rules, *, model_config, opts, scale):
    """(loss · scale, (loss, model metrics)) for token rows [B, S+1] (inputs and shifted targets),
    run with `rules` (the data-parallel path may drop axes from the run options' rules)."""
    opts = dataclasses.replace(opts, rules=rules)
    logits, aux = models.apply(model_config, params, rows[:, :-1], opts)
    with jax.named_scope("loss"):
        extra, metrics = models.aux_losses(model_config, aux)
        loss = mean_cross_entropy(logits, rows[:, 1:]) + extra
    return loss * scale, (loss, metrics)
