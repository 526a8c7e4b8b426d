"""How much of the causal attention work context parallelism's kernels actually run.

The blockwise kernels (`jaxpar.parallel.context.blockwise`) cut queries and keys into chunks and
skip, by `lax.cond`, every chunk pair whose keys all lie after all its queries. So a device runs
only the unmasked chunk pairs of its queries against the whole sequence: about half at long
sequences (n(n+1)/2 of n^2 pairs with n chunks), more at short ones. `attention_fraction` counts
them exactly from the kernels' own chunking, for the busiest context rank. The compiled HLO
cannot show this (it counts both branches of every cond: an upper bound).

A sliding layer's window skips more: chunk pairs whose keys all lie a window or more before every
query (`window_fraction`), over the keys the layer's exchange brings: with the windowed exchange
(`jaxpar.parallel.context.window`) this rank's block and the pieces its window reaches (the ring
chunks each alike, all_gather their concatenation), else every rank's block.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxpar.parallel.context.blockwise import chunk_size
from jaxpar.parallel.context.sharded import load_balance_order
from jaxpar.parallel.context.window import hops


def _chunks(positions: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) position of each consecutive chunk of `size` tokens."""
    blocks = positions.reshape(-1, size)
    return blocks.min(axis=1), blocks.max(axis=1)


@functools.lru_cache(maxsize=1024)
def attention_fraction(impl: str, seq: int, c: int, block: int, load_balance: bool) -> float:
    """Fraction of the S/c x S query-key products the busiest context rank computes."""
    order = load_balance_order(seq, c) if load_balance else np.arange(seq)
    local = seq // c
    shards = order.reshape(c, local)  # rank r's positions, in the sharded order
    if impl == "all_to_all":  # whole sequences (1/c of the heads) through the plain blockwise kernel
        q_lo, q_hi = _chunks(order, chunk_size(seq, block))
        k_lo, _ = _chunks(order, chunk_size(seq, block))
        size_q, size_k = chunk_size(seq, block), chunk_size(seq, block)
        done = (k_lo[None, :] <= q_hi[:, None]).sum() * size_q * size_k
        return float(done / (seq * seq))
    worst = 0.0
    for r in range(c):
        size_q = chunk_size(local, block)
        _, q_hi = _chunks(shards[r], size_q)
        if impl == "all_gather":  # the gathered sequence is one key block
            size_k = chunk_size(seq, block)
            k_lo, _ = _chunks(order, size_k)
        else:  # ring: one block per rank, each chunked alike
            size_k = chunk_size(local, block)
            k_lo, _ = _chunks(order, size_k)
        done = (k_lo[None, :] <= q_hi[:, None]).sum() * size_q * size_k
        worst = max(worst, done / (local * seq))
    return float(worst)


def _done(q_lo, q_hi, k_lo, k_hi, window: int) -> int:
    """Chunk pairs the kernel computes: some key not after some query, and (a window) not every key
    a window or more before every query."""
    live = k_lo[None, :] <= q_hi[:, None]
    if window:
        live &= q_lo[:, None] - k_hi[None, :] < window
    return int(live.sum())


def _key_blocks(impl: str, shards: np.ndarray, r: int, window: int, windowed: bool, balanced: bool) -> list[np.ndarray]:
    """Positions of the key blocks rank r folds, each chunked on its own by the kernel."""
    c, local = shards.shape
    if not windowed:
        return [shards.reshape(-1)] if impl == "all_gather" else list(shards)
    pieces = []
    for hop in hops(c, local, window, balanced):
        sources = [src for src, dst in hop.pairs if dst == r]
        if sources:
            block = shards[sources[0]]
            pieces.append(block if hop.piece is None else block.reshape(2, -1)[hop.piece[sources[0]]])
    blocks = [shards[r]] + pieces
    return [np.concatenate(blocks)] if impl == "all_gather" else blocks


@functools.lru_cache(maxsize=1024)
def window_fraction(impl: str, seq: int, c: int, block: int, load_balance: bool, window: int, windowed: bool) -> float:
    """`attention_fraction` of a sliding layer with `window` (`windowed`: its exchange stops at the
    window, `comm_context.window_hops`): the fraction of the S/c x S query-key products the busiest
    rank computes."""
    order = load_balance_order(seq, c) if load_balance else np.arange(seq)
    if impl == "all_to_all":  # whole sequences through the plain blockwise kernel
        size = chunk_size(seq, block)
        lo, hi = _chunks(order, size)
        return float(_done(lo, hi, lo, hi, window) * size * size / (seq * seq))
    local = seq // c
    shards = order.reshape(c, local)
    worst = 0
    for r in range(c):
        size_q = chunk_size(local, block)
        q_lo, q_hi = _chunks(shards[r], size_q)
        done = 0
        for keys in _key_blocks(impl, shards, r, window, windowed, load_balance):
            size_k = chunk_size(len(keys), block)
            k_lo, k_hi = _chunks(keys, size_k)
            done += _done(q_lo, q_hi, k_lo, k_hi, window) * size_q * size_k
        worst = max(worst, done)
    return float(worst / (local * seq))
