"""How much of the causal attention work context parallelism's kernels actually run.

The blockwise kernels (`jaxpar.parallel.context.blockwise`) cut queries and keys into chunks and
skip, by `lax.cond`, every chunk pair whose keys all lie after all its queries. So a device runs
only the unmasked chunk pairs of its queries against the whole sequence: about half at long
sequences (n(n+1)/2 of n^2 pairs with n chunks), more at short ones. `attention_fraction` counts
them exactly from the kernels' own chunking, for the busiest context rank. The compiled HLO
cannot show this (it counts both branches of every cond: an upper bound).
"""

from __future__ import annotations

import functools

import numpy as np

from jaxpar.parallel.context.blockwise import chunk_size
from jaxpar.parallel.context.sharded import load_balance_order


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
