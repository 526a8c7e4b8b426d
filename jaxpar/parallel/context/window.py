"""Context-parallel exchanges that reach only as far as a sliding window.

A sliding layer's query sees keys at most `span` - 1 tokens before it (within its document, so a
packed document only narrows it). Which ranks hold such keys is static geometry once the layout is
known: contiguous (rank r holds text chunk r of c) or load-balanced (`load_balance_order`: rank r
holds chunks r and 2c-1-r of 2c, its two "pieces"). `hops` lists, for each shift d = (receiver -
sender) mod c that anything crosses, the (sender, receiver) pairs whose pieces some query of the
receiver can see, and which piece travels (the whole block when a receiver needs both): one
collective-permute per hop, instead of the ring's c - 1 (or the whole sequence's all-gather).

  contiguous, window <= chunk C: 1 hop (the previous rank's block), ceil((W-1)/C) in general;
  load-balanced, window <= C/2:  2 hops of half a block (the previous rank's low piece, the next
                                 rank's high piece) — one block's bytes.

The exchange runs inside a shard_map manual over the context axis; a rank that receives nothing
in a hop gets zeros from `ppermute`, so its received positions are set to `NOWHERE` (after every
query: fully masked, the block's work skipped). The backward fetches the pieces again (nothing of
other ranks is saved, as in the ring) and sends each piece's dK, dV back along the reversed pairs.

Which exchange a layer runs: `Reach.sliding` True / False (known statically), or None: the layer's
window is a traced per-layer value (the layer scan's), and a `lax.cond` on it picks the windowed
or the full exchange. Every rank runs the same layer at once, so every rank takes the same branch
and its permutes' rendezvous completes (measured on XLA:CPU). Inside the pipeline engine stages
run different layers at once (a permute in a branch only some ranks take deadlocks on XLA:CPU), so
there the model passes no `Reach` (`sharded.model_attention`) and the full exchange runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.context import blockwise as bw

# A received position where nothing arrived: later than every query, so never visible.
NOWHERE = np.iinfo(np.int32).max


class Reach(NamedTuple):
    """Static facts that let a layer's exchange stop where its window does: `span` the widest window
    it serves (the model's sliding_window), `balanced` the load-balanced layout (else contiguous,
    text order), `sliding` whether this layer slides (window in 1 .. span) when known statically,
    None: the traced window decides by `lax.cond`."""

    span: int
    balanced: bool
    sliding: bool | None = None


class Hop(NamedTuple):
    """One collective-permute: (sender, receiver) pairs; per device the piece it sends (None: whole
    blocks travel) and whether it receives."""

    pairs: tuple[tuple[int, int], ...]
    piece: tuple[int, ...] | None
    receives: tuple[bool, ...]


def resolve(reach: Reach | None, window) -> Reach | None:
    """`reach` with `sliding` filled in when the window is a Python (or NumPy) integer."""
    if reach is None or window is None or not isinstance(window, (int, np.integer)):
        return reach
    return reach._replace(sliding=bool(0 < int(window) <= reach.span))


def _text_chunk(rank: int, piece: int, c: int, balanced: bool) -> int:
    return 2 * c - 1 - rank if balanced and piece else rank


@functools.lru_cache(maxsize=256)
def hops(c: int, local_len: int, span: int, balanced: bool) -> tuple[Hop, ...]:
    """The permutes a window of `span` needs with c ranks of `local_len` tokens (see the module docstring)."""
    pieces = 2 if balanced else 1
    size = local_len // pieces

    def sees(a, b):  # some query of text chunk a sees some key of chunk b (nearest pair: (a-b-1)·size + 1 apart)
        return b < a and (a - b - 1) * size + 1 < span

    by_shift: dict[int, list] = {}
    for dst in range(c):
        for src in range(c):
            need = sorted({ps for ps in range(pieces) for pd in range(pieces)
                           if sees(_text_chunk(dst, pd, c, balanced), _text_chunk(src, ps, c, balanced))})
            if src != dst and need:
                by_shift.setdefault((dst - src) % c, []).append((src, dst, need))
    out = []
    for shift in sorted(by_shift):
        entries = by_shift[shift]
        whole = any(len(need) == pieces for _, _, need in entries)
        sends = {src: need[0] for src, _, need in entries}
        out.append(Hop(
            pairs=tuple((src, dst) for src, dst, _ in entries),
            piece=None if whole else tuple(sends.get(i, 0) for i in range(c)),
            receives=tuple(any(dst == i for _, dst, _ in entries) for i in range(c)),
        ))
    return tuple(out)


def plan_hops(reach: Reach | None, window, axis_name, local_len: int) -> tuple[Hop, ...] | None:
    """The windowed exchange for this call, or None where the full one runs: no `Reach`, a layer
    known to be full, or a window that reaches every rank's whole block anyway."""
    if reach is None or window is None or reach.sliding is False:
        return None
    c = jax.lax.axis_size(axis_name)
    found = hops(c, local_len, reach.span, reach.balanced)
    if len(found) < c - 1 or any(hop.piece is not None for hop in found):
        return found
    return None


def by_kind(reach: Reach, window, found, windowed, full):
    """`windowed()` on a sliding layer, `full()` on a full one (a `lax.cond` on a traced window)."""
    if found is None:
        return full()
    if reach.sliding:
        return windowed()
    return jax.lax.cond((window > 0) & (window <= reach.span), windowed, full)


def _index(table, axis_name):
    return jnp.asarray(table, jnp.int32)[jax.lax.axis_index(axis_name)]


def _pieces(x, count):
    return x.reshape(x.shape[0], count, x.shape[1] // count, *x.shape[2:])


def _sent(x, hop: Hop, count: int, axis_name):
    if hop.piece is None:
        return x
    return jax.lax.dynamic_index_in_dim(_pieces(x, count), _index(hop.piece, axis_name), axis=1, keepdims=False)


def fetch(hop: Hop, k, v, tags: bw.Tags, balanced: bool, axis_name):
    """(k, v, tags) of the piece (or block) this rank receives in `hop`; NOWHERE positions if none."""
    count = 2 if balanced else 1
    sent = jax.tree.map(lambda x: _sent(x, hop, count, axis_name), (k, v, tags))
    k, v, tags = jax.lax.ppermute(sent, axis_name, list(hop.pairs))
    got = _index(hop.receives, axis_name) > 0
    return k, v, tags._replace(pos=jnp.where(got, tags.pos, NOWHERE))


def give_back(hop: Hop, dk, dv, dk_piece, dv_piece, balanced: bool, axis_name):
    """dk, dv (this rank's block, fp32) plus the gradients its receivers computed for what it sent."""
    back = jax.lax.ppermute((dk_piece, dv_piece), axis_name, [(dst, src) for src, dst in hop.pairs])
    if hop.piece is None:
        return dk + back[0], dv + back[1]
    count, at = 2 if balanced else 1, _index(hop.piece, axis_name)

    def add(x, part):  # a rank that sent nothing gets zeros back: adding them anywhere is harmless
        parts = _pieces(x, count)
        current = jax.lax.dynamic_index_in_dim(parts, at, axis=1, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(parts, current + part, at, axis=1).reshape(x.shape)

    return add(dk, back[0]), add(dv, back[1])


def window_blocks(k, v, kv_pos, axis_name, found, balanced: bool):
    """A key/value source (`local._forward`) folding this rank's block, then each hop's piece."""

    def run(fold, acc):
        acc = fold(acc, k, v, kv_pos)
        for hop in found:
            acc = fold(acc, *fetch(hop, k, v, kv_pos, balanced, axis_name))
        return acc

    return run


def window_gather(k, v, kv_pos, axis_name, found, balanced: bool):
    """This rank's block and every piece the window reaches, concatenated: the keys to attend."""
    parts = [(k, v, kv_pos)] + [fetch(hop, k, v, kv_pos, balanced, axis_name) for hop in found]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *parts)


def window_grads(dq, grads, q_pos, k, v, kv_pos, axis_name, found, balanced: bool, window, block_kv):
    """(dq, dk, dv fp32) of the windowed exchange: `grads(dq, k, v, kv_pos, block_kv)` on this
    rank's block and on each hop's piece fetched again, whose dK, dV go back to their sender."""
    dq, dk, dv = grads(dq, k, v, kv_pos, block_kv)
    for hop in found:
        kb, vb, tb = fetch(hop, k, v, kv_pos, balanced, axis_name)
        zeros = bw.varying(jnp.zeros(kb.shape, bw.F32))

        def work(args, kb=kb, vb=vb, tb=tb):
            return grads(args[0], kb, vb, tb, block_kv)

        dq, dkb, dvb = jax.lax.cond(bw.all_masked(q_pos, tb, window), lambda args: args, work, (dq, zeros, zeros))
        dk, dv = give_back(hop, dk, dv, dkb, dvb, balanced, axis_name)
    return dq, dk, dv
