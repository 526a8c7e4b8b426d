"""The batch as the model sees it: tokens, targets, true positions, segments and target weights,
in the order context parallelism shards the sequence.

Two batch kinds reach the train step (`jaxpar.data`): token rows [G, S+1] (one sequence per row)
and packed documents [G, 2, S+1] (channel 0 the tokens, channel 1 each token's segment id, 0 for
padding). `document_batch` turns the second into {"rows", "segments", "weights"} once, on the
global batch, before it is split into microbatches: a target counts only when it continues its
input's document (never padding, never across a boundary), and its weight is
1 / (real targets of the global batch) × (target slots of the global batch). Every gradient path
averages per-part means over parts holding equal numbers of slots, so mean(loss · weight) of any
part, averaged like that, is the sum of real target losses over their global count: the same number
on every mesh, with any microbatch count. (Token rows have no weights: a plain mean.)

With load balancing the sequence is permuted once, inside the step, before the model sees it
(`load_balance_order`: rank r of c holds chunks r and 2c-1-r of 2c). Tokens, targets, segments and
weights move together and every token carries its true position, so RoPE and the causal mask
(computed from positions, never from array indices) are unchanged, and the loss is the same number.
A packed document's positions restart at 0 at its first token in the row. The data pipeline never
sees the mesh: batches stay rows in text order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.context.plan import ContextPlan
from jaxpar.parallel.context.sharded import load_balance_order
from jaxpar.sharding import constrain


class TokenBatch(NamedTuple):
    """Model inputs and loss targets, each [..., S] (None where the batch kind has none)."""

    tokens: jax.Array
    targets: jax.Array
    positions: jax.Array | None  # None: 0 .. S-1 (token rows without context parallelism)
    segment_ids: jax.Array | None  # packed documents only; 0 marks padding
    weights: jax.Array | None  # packed documents only: fp32 weight of each target (see the module docstring)


def default_positions(tokens):
    """Positions 0 .. S-1 of every row of tokens [B, S] (one document per row, text order)."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape[:2])


def segment_positions(segments):
    """Each token's position in its segment run, [..., S] int32 in text order: 0 where the
    segment id changes (and at the row's start), counting up until the next change."""
    length = segments.shape[-1]
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segments.shape)
    first = jnp.concatenate([jnp.ones_like(segments[..., :1], bool), segments[..., 1:] != segments[..., :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(first, index, 0), axis=segments.ndim - 1)
    return index - start


def real_targets(segments):
    """[..., S] bool from segment ids [..., S+1]: the input's next token is a real target (same
    document, not padding)."""
    return (segments[..., :-1] == segments[..., 1:]) & (segments[..., :-1] > 0)


def is_document_batch(batch) -> bool:
    return isinstance(batch, dict) or batch.ndim == 3


def document_batch(batch):
    """The train step's view of a global batch: token rows [G, S+1] unchanged; packed documents
    [G, 2, S+1] as {"rows" [G, S+1], "segments" [G, S+1], "weights" [G, S] fp32}."""
    if not is_document_batch(batch) or isinstance(batch, dict):
        return batch
    rows, segments = batch[:, 0], batch[:, 1]
    real = real_targets(segments)
    if batch.shape[1] > 2:  # a loss mask (`jaxpar.data.formats`: chat, prompt_completion): only its targets count
        real = real & (batch[:, 2, 1:] > 0)
    count = jnp.maximum(jnp.sum(real, dtype=jnp.int32), 1)  # an all-padding batch: loss 0
    weights = jnp.where(real, jnp.float32(real.size) / count.astype(jnp.float32), jnp.float32(0))
    return {"rows": rows, "segments": segments, "weights": weights}


def target_count(batch):
    """Real targets of a global batch (token rows: every slot), int32."""
    if not is_document_batch(batch):
        return jnp.int32(batch.shape[0] * (batch.shape[1] - 1))
    if isinstance(batch, dict):  # `document_batch`'s: weights > 0 exactly at the real targets
        return jnp.sum(batch["weights"] > 0, dtype=jnp.int32)
    return jnp.sum(document_batch(batch)["weights"] > 0, dtype=jnp.int32)


class Ahead(NamedTuple):
    """Multi-token prediction's inputs and targets, each [D, ..., S]: at depth k (1 .. D) and
    position i, token i + k (the module's input), token i + k + 1 (its target) and that target's
    weight (0 past the row's end or across a document boundary)."""

    tokens: jax.Array
    targets: jax.Array
    weights: jax.Array


def _shifted(x, k: int):
    """x [..., S] moved k slots to the left along the sequence, zeros coming in at the end."""
    if k == 0:
        return x
    return jnp.concatenate([x[..., k:], jnp.zeros(x.shape[:-1] + (k,), x.dtype)], axis=-1)


def ahead_rows(rows, depth: int) -> Ahead:
    """`Ahead` of int rows [..., S+1] (or `document_batch`'s dict), in text order. A target counts
    when every next-token link from position i to it is a real target (`document_batch`'s weights:
    same document, no padding), with the main loss's weight, so each depth's mean(loss · weight)
    sums over its real targets with the main loss's normaliser; token rows weigh 1 up to the row's end."""
    packed = isinstance(rows, dict)
    targets = (rows["rows"] if packed else rows)[..., 1:]
    real = rows["weights"] if packed else jnp.ones(targets.shape, jnp.float32)
    tokens, later, weights = [], [], []
    weight, links = real, real > 0
    for k in range(1, depth + 1):
        links = links & (_shifted(real, k) > 0)
        tokens.append(_shifted(targets, k - 1))
        later.append(_shifted(targets, k))
        weights.append(jnp.where(links, weight, jnp.zeros((), weight.dtype)))
    return Ahead(jnp.stack(tokens), jnp.stack(later), jnp.stack(weights))


def split_ahead(rows, depth: int, plan: ContextPlan | None, rules, names=("batch", "seq")) -> Ahead:
    """`ahead_rows` in the plan's sequence order, laid out as (None,) + `names`: computed on whole
    rows in text order before any split, so no token has to cross a context rank."""
    ahead = ahead_rows(rows, depth)
    order = None if plan is None else sequence_order(plan, ahead.tokens.shape[-1])
    if order is not None:
        ahead = jax.tree.map(lambda x: x[..., order], ahead)
    return jax.tree.map(lambda x: constrain(rules, x, (None,) + tuple(names)), ahead)


def sequence_order(plan: ContextPlan | None, seq_len: int) -> np.ndarray | None:
    """Text position of each sequence slot (a permutation of range(seq_len)); None: text order."""
    if plan is None or not plan.load_balance:
        return None
    return load_balance_order(seq_len, plan.size)


def split_rows(rows, plan: ContextPlan | None, rules, names=("batch", "seq")) -> TokenBatch:
    """The `TokenBatch` of int rows [..., S+1] (or `document_batch`'s dict of them, with any
    leading axes): inputs, next-token targets, true positions (and segments, weights), each
    [..., S] in the plan's sequence order and laid out as `names` (`seq` is split over context
    by the rules table). Token rows without context parallelism keep positions None (the
    model's default: 0 .. S-1)."""
    if isinstance(rows, dict):
        tokens, targets = rows["rows"][..., :-1], rows["rows"][..., 1:]
        segments = rows["segments"][..., :-1]
        batch = TokenBatch(tokens, targets, segment_positions(segments), segments, rows["weights"])
    else:
        batch = TokenBatch(rows[..., :-1], rows[..., 1:], None, None, None)
    if plan is None:
        return batch
    seq_len = batch.tokens.shape[-1]
    if batch.positions is None:  # token rows: a token's true position is its text position
        batch = batch._replace(positions=jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), batch.tokens.shape))
    order = sequence_order(plan, seq_len)
    if order is not None:
        batch = jax.tree.map(lambda x: x[..., order], batch)
    return jax.tree.map(lambda x: constrain(rules, x, names), batch)
