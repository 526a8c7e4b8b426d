"""The batch in the order context parallelism shards it: tokens, targets and true positions.

With load balancing the sequence is permuted once, inside the step, before the model sees it
(`load_balance_order`: rank r of c holds chunks r and 2c-1-r of 2c). Tokens and their targets move
together and every token carries its true position, so RoPE and the causal mask (computed from
positions, never from array indices) are unchanged, and the loss — a mean over tokens — is the
same number. The data pipeline never sees the mesh: batches stay [B, S+1] rows in text order.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.context.plan import ContextPlan
from jaxpar.parallel.context.sharded import load_balance_order
from jaxpar.sharding import constrain


def default_positions(tokens):
    """Positions 0 .. S-1 of every row of tokens [B, S] (one document per row, text order)."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape[:2])


def sequence_order(plan: ContextPlan | None, seq_len: int) -> np.ndarray | None:
    """Text position of each sequence slot (a permutation of range(seq_len)); None: text order."""
    if plan is None or not plan.load_balance:
        return None
    return load_balance_order(seq_len, plan.size)


def split_rows(rows, plan: ContextPlan | None, rules, names=("batch", "seq")):
    """(tokens, targets, positions) from int rows [..., S+1]: inputs, next-token targets and
    true positions, each [..., S] in the plan's sequence order and laid out as `names`
    (`seq` is split over context by the rules table). positions is None without context
    parallelism (the model's default: 0 .. S-1)."""
    tokens, targets = rows[..., :-1], rows[..., 1:]
    if plan is None:
        return tokens, targets, None
    seq_len = tokens.shape[-1]
    order = sequence_order(plan, seq_len)
    if order is not None:
        tokens, targets = tokens[..., order], targets[..., order]
    text_positions = np.arange(seq_len) if order is None else order
    positions = jnp.broadcast_to(jnp.asarray(text_positions, jnp.int32), tokens.shape)
    return tuple(constrain(rules, x, names) for x in (tokens, targets, positions))
