"""Next-token cross-entropy on vocab-sharded logits.

The logsumexp and the label pick are both reductions over the vocab axis, so with logits sharded
over `tensor` the partitioner all-reduces [B, S] scalars instead of gathering [B, S, V] logits.
"""

import jax
import jax.numpy as jnp


def token_cross_entropy(logits, targets):
    """Per-token loss [B, S] from fp32 logits [B, S, V] (padded columns already masked)."""
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    # A masked sum rather than take_along_axis: a gather on the sharded vocab axis would
    # make the partitioner collect the whole vocab on every device.
    label_logit = jnp.sum(jnp.where(column == targets[..., None], logits, 0.0), axis=-1)
    return log_normalizer - label_logit


def mean_cross_entropy(logits, targets):
    return jnp.mean(token_cross_entropy(logits, targets))
