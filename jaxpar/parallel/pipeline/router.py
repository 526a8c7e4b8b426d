"""MoE auxiliary losses through the pipeline: router statistics accumulated beside the activations.

The load-balancing and z losses (`jaxpar.models.moe.aux_losses`) are functions of one
microbatch's router statistics summed over every layer and every row — as the non-pipelined step
computes them, per microbatch under `train.grad_accum` (the pipeline's microbatches are the same
rows). In the engine each rank adds, at every F, its stage's statistics to a per-microbatch table
[m, ...]; at the step where the last stage runs F for microbatch k all of k's forwards are done,
so one psum over `pipeline` and the manual batch axes gives k's totals on every rank ([E]-sized:
negligible traffic). They yield k's aux loss and metrics, and are kept: every later B/W of k
(on any stage) pulls back the gradient of the aux losses with respect to the totals — the aux
losses are sums over layers, so that is exactly each stage's share. Proven equal to one device
(with `grad_accum` = m) by `tests/parallel/pipeline/test_pipeline_moe.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def totals_tree(stats):
    """The statistics as `aux_losses` reads them: a stack of one "layer" holding the totals."""
    return jax.tree.map(lambda a: a[None], stats)


def loss_and_metrics(model, totals):
    """(coefficient-weighted aux + z loss, metrics) of one microbatch from its totals (`model`:
    the `stage.StageModel`)."""
    return model.aux_losses(totals_tree(totals))


def totals_grad(model, totals):
    """d(aux + z loss) / d totals: the cotangent of every stage's summed statistics."""
    if not totals:
        return {}
    grad = jax.grad(lambda t: loss_and_metrics(model, t)[0])(totals)
    # Totals not known yet (all zero: an idle step's placeholder) give 0/0; nothing reads them.
    return jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grad)


def zero_metrics(model, stats_shapes):
    """Zeros shaped like `loss_and_metrics`' metrics ({} for dense models)."""
    if not stats_shapes:
        return {}
    ones = jax.tree.map(lambda s: jnp.ones(s.shape, jnp.float32), stats_shapes)
    return jax.tree.map(jnp.zeros_like, loss_and_metrics(model, ones)[1])
