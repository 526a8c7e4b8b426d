"""Vocabulary parallelism over `pipeline`: embedding, LM head and loss on every rank's vocab shard.

What it shards: with `mesh.pipeline` = p > 1 the rules table splits the vocab dimension of the
embedding and LM head (tied or not) over `pipeline` × `tensor`, so rank r holds rows [r·V/p,
(r+1)·V/p) — with their gradients and Adam moments — instead of every rank holding all of them:
1/p of the per-device bytes. The final norm's [D] scale stays replicated (tiny).

Who computes: every rank, on its own shard, so no step ever moves a table (the traffic is
activation-sized, whatever the vocab). Per step of the engine, outside the per-rank branches:
- `lookup`: each rank gathers the rows it holds for stage 0's tokens (zeros for the others) and
  one psum over `pipeline` completes the embedding (for this step's F and B/W on stage 0). The
  embedding gradient is the reverse: stage 0's input gradient is psummed to every rank, and each
  scatters it into its own rows.
- `head_loss` (only at steps where the last stage runs F, a condition every rank shares): the
  last stage's output is psummed to every rank, each applies the final norm and its [D, V/p]
  head shard, and the vocab-parallel cross-entropy combines the log-normaliser and the label
  logit over `pipeline` (two [mb, S] psums; `tensor` is left to the partitioner as in
  `jaxpar.parallel.tensor.cross_entropy`). Differentiated right there, it yields each rank's head
  gradient and, summed over ranks by the transpose of the broadcast, the last stage's output
  gradient, which the last stage's B reads like any received gradient.

So the LM head's FLOPs are split evenly over the ranks rather than loaded on the last stage (the
imbalance the source article balances by moving layers; this is "vocabulary parallelism", Yeung
et al. 2024). Cost: per microbatch four [mb, S, D] all-reduces over `pipeline` (embedding,
embedding gradient, head input, its gradient) and two [mb, S] ones.

Proven equal to one device by `tests/parallel/pipeline/test_pipeline.py` (tied and untied, with tensor, data and
ZeRO); the bytes per device by `test_vocab_tables_per_device_bytes_fall_with_pipeline` and the
absence of table-sized collectives by `test_no_collective_moves_a_vocab_table` there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.axes import PIPELINE
from jaxpar.sharding import constrain


def shard_offset(rows_here: int):
    """The first vocab row this pipeline rank holds."""
    return jax.lax.axis_index(PIPELINE) * rows_here


def lookup(table, tokens, offset, scale: float | None = None):
    """This rank's part of the embedding of `tokens`: its rows, zeros where another rank holds the
    token. A psum over `pipeline` completes it. `scale`: the model's embedding scale
    (`Decoder.embedding_scale`: rounded to fp32, then to the table's dtype), None: none."""
    local = tokens - offset
    mine = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    if scale is not None:
        rows = rows * jnp.asarray(scale, jnp.float32).astype(rows.dtype)
    return jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))


def head_loss(normed, head, targets, offset, vocab_size: int, rules, weights=None, softcap: float | None = None,
              per_token: bool = False):
    """Mean cross-entropy of [mb, S, D] final-normed activations against targets [mb, S], with this
    rank's head shard [D, V/p] (fp32 logits, padded columns masked, combined over `pipeline`);
    with `weights` [mb, S] the mean of loss · weight (packed documents); `softcap`: the logits
    capped first (`Decoder.final_logit_softcap`). `per_token`: each target's loss [mb, S] instead
    (DPO's sequence sums), `weights` unused."""
    with jax.named_scope("lm_head"):
        if normed.dtype == jnp.float16:  # as `jaxpar.models.layers.project_to_vocab`
            normed, head = normed.astype(jnp.float32), head.astype(jnp.float32)
        logits = jnp.einsum("bsd,dv->bsv", normed, head, preferred_element_type=jnp.float32)
        logits = constrain(rules, logits, ("batch", "seq", "act_vocab"))
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        column = offset + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        logits = jnp.where(column < vocab_size, logits, jnp.finfo(jnp.float32).min)
    with jax.named_scope("loss"):
        local = jax.nn.logsumexp(logits, axis=-1)
        top = jax.lax.pmax(jax.lax.stop_gradient(local), PIPELINE)
        log_normalizer = top + jnp.log(jax.lax.psum(jnp.exp(local - top), PIPELINE))
        label = jax.lax.psum(jnp.sum(jnp.where(column == targets[..., None], logits, 0.0), axis=-1), PIPELINE)
        losses = log_normalizer - label
        if per_token:
            return losses
        return jnp.mean(losses if weights is None else losses * weights)
