"""Per-device causal attention for a sequence sharded over one manual mesh axis.

Call these inside a `shard_map` that is manual over `axis_name` (and over whatever shards heads).
Each gets this rank's q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D] and the true positions q_pos [B, Sq],
kv_pos [B, Sk] (int32; or [Sq], [Sk] when every row has the same positions), optionally the
segment ids of packed documents q_seg [B, Sq], kv_seg [B, Sk] (0: padding; a padding query's
output is 0), and returns this rank's output [B, Sq, Hq, D] in q's dtype. Shared positions keep the skip predicates free of any
batch reduction: no all-reduce over an Auto batch axis, and under vmap the `lax.cond`s stay
conds (a batched predicate turns a cond into a select that runs both branches).

Every variant is a `jax.custom_vjp` that saves only this rank's inputs, the output and the
log-sum-exp, and recomputes the scores in the backward (flash attention): no score block and no
gathered or received K/V block is kept for the backward.

A layer's attention pattern (`jaxpar.models.attention_pattern`) comes as keywords: `window` (int32
scalar, possibly traced — scanned per layer; 0: full), `sinks` [Hq] (this rank's query heads;
differentiable: each rank returns its queries' share of their gradient, which the caller's
shard_map sums over the ranks like any replicated input's) and `softcap` (a Python float). The
mask reads true positions, so the window is exact in any sequence order and over gathered or
received keys; the skip predicates also skip key chunks (and, for the ring, whole blocks) that lie
a window or more before every query.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.parallel.context import blockwise as bw
from jaxpar.parallel.context import window as wn
from jaxpar.parallel.context.blockwise import Pattern, Tags

# Query / key chunk: the largest score array is [B, Hkv, G, 512, 512] fp32. Measured on the train
# step (scripts/context_report.py, S = 16384, c = 4, ring, 8 heads): temp 135, 135, 148, 245, 632
# MiB per device for blocks 128, 256, 512, 1024, 2048 — below 512 other activations dominate.
DEFAULT_BLOCK = 512


def _rows(pos):
    """Positions as [B or 1, S]: a row of 1 broadcasts over the batch."""
    return pos[None] if pos.ndim == 1 else pos


def _tags(pos, seg) -> Tags:
    return Tags(_rows(pos), seg)


def _scale(scale, head_dim):
    return head_dim**-0.5 if scale is None else scale


class Extras(NamedTuple):
    """The pattern's array parts, differentiable arguments of the custom VJPs: window int32 scalar
    or None, sinks [Hq] or None."""

    window: jax.Array | None = None
    sinks: jax.Array | None = None


def _extras(window, sinks) -> Extras:
    return Extras(None if window is None else jnp.asarray(window, jnp.int32), sinks)


def _pattern(extras: Extras, softcap, num_kv_heads) -> Pattern:
    sinks = None if extras.sinks is None else extras.sinks.astype(bw.F32).reshape(num_kv_heads, -1)
    return Pattern(extras.window, softcap, sinks)


def _extras_grad(extras: Extras, pattern: Pattern, lse, delta) -> Extras:
    """The cotangent of `extras`: None for the window, the sinks' gradient for this rank's queries."""
    if extras.sinks is None:
        return Extras(None, None)
    return Extras(None, bw.sink_grads(pattern.sinks, lse, delta).reshape(extras.sinks.shape).astype(extras.sinks.dtype))


def _query_chunks(q, q_pos: Tags, num_kv_heads, block_q):
    """q [B, S, Hq, D] -> [nq, B, cq, Hkv, G, D]; q_pos's arrays [B, S] -> [nq, B, cq]."""
    b, s, hq, d = q.shape
    if hq % num_kv_heads:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {num_kv_heads} key/value heads")
    # Positions are the same in every layer: without tying them to this layer's q, the masks
    # built from them are loop-invariant, and XLA hoists them out of the layer scan for every
    # chunk pair at once — an [S/c, S] mask per head (measured: 512 MiB buffers at S = 8192).
    q, q_pos = jax.lax.optimization_barrier((q, q_pos))
    cq = bw.chunk_size(s, block_q)
    q5 = q.reshape(b, s, num_kv_heads, hq // num_kv_heads, d)
    return bw.split_chunks(q5, cq), bw.split_tags(q_pos, cq)


def _unchunk(x_chunks, like):
    """[nq, B, cq, Hkv, G, D] -> [B, S, Hq, D] in like's dtype."""
    return bw.merge_chunks(x_chunks).reshape(like.shape).astype(like.dtype)


def _forward(q, q_pos, num_kv_heads, kv_blocks, *, scale, block_q, block_kv, skip_masked_blocks,
             pattern: Pattern = bw.NO_PATTERN):
    """Runs the online softmax over `kv_blocks(fold, acc)`, a function that calls `fold(acc, k, v,
    kv_pos)` for each key/value block in turn. Returns (out, lse chunks)."""
    q_chunks, qpos_chunks = _query_chunks(q, q_pos, num_kv_heads, block_q)
    scale = _scale(scale, q.shape[-1])

    def fold(acc, k, v, kv_pos):
        def work(acc):
            return bw.forward_block(acc, q_chunks, qpos_chunks, k, v, kv_pos, scale=scale, block_kv=block_kv,
                                    pattern=pattern)

        if not skip_masked_blocks:
            return work(acc)
        return jax.lax.cond(bw.all_masked(q_pos, kv_pos, pattern.window), lambda acc: acc, work, acc)

    acc = kv_blocks(fold, bw.init_accumulator(q_chunks))
    o_chunks, lse = bw.finalize(acc, pattern.sinks)
    return _unchunk(o_chunks, q), lse


def _backward(q, q_pos, out, lse, d_out, num_kv_heads, *, scale, block_q, pattern: Pattern = bw.NO_PATTERN):
    """What every backward needs: query-side chunks, delta = rowsum(do · o) and a zero dq; also
    returns delta (for the sinks' gradient)."""
    q_chunks, qpos_chunks = _query_chunks(q, q_pos, num_kv_heads, block_q)
    do_chunks, _ = _query_chunks(d_out.astype(q.dtype), q_pos, num_kv_heads, block_q)
    o_chunks, _ = _query_chunks(out, q_pos, num_kv_heads, block_q)
    delta = jnp.sum(do_chunks.astype(bw.F32) * o_chunks.astype(bw.F32), axis=-1)  # [nq, B, cq, Hkv, G]
    delta = jnp.moveaxis(delta, 2, -1)  # -> lse layout [nq, B, Hkv, G, cq]
    dq = bw.varying(jnp.zeros(q_chunks.shape, bw.F32))
    scale = _scale(scale, q.shape[-1])

    def grads(dq, k, v, kv_pos, block_kv):
        return bw.backward_block(
            dq, q_chunks, qpos_chunks, do_chunks, lse, delta, k, v, kv_pos, scale=scale, block_kv=block_kv,
            pattern=pattern,
        )

    return dq, grads, delta


def _single(k, v, kv_pos: Tags):
    """A key/value source with one block (see `_forward`)."""
    return lambda fold, acc: fold(acc, k, v, kv_pos)


# ---------------------------------------------------------------- plain local flash attention


def flash_attention_local(q, k, v, q_pos, kv_pos, *, q_seg=None, kv_seg=None, scale=None, block_q=DEFAULT_BLOCK,
                          block_kv=DEFAULT_BLOCK, window=None, sinks=None, softcap=None):
    """Causal attention of q against k / v on one device, chunked (no collective)."""
    return _flash_attention(q, k, v, _tags(q_pos, q_seg), _tags(kv_pos, kv_seg), _extras(window, sinks), scale,
                            block_q, block_kv, softcap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash_attention(q, k, v, q_pos, kv_pos, extras, scale, block_q, block_kv, softcap):
    return _flash_fwd(q, k, v, q_pos, kv_pos, extras, scale, block_q, block_kv, softcap)[0]


def _flash_fwd(q, k, v, q_pos, kv_pos, extras, scale, block_q, block_kv, softcap):
    blocks = _single(k, v, kv_pos)
    out, lse = _forward(q, q_pos, k.shape[2], blocks, scale=scale, block_q=block_q, block_kv=block_kv,
                        skip_masked_blocks=False, pattern=_pattern(extras, softcap, k.shape[2]))
    return out, (q, k, v, q_pos, kv_pos, extras, out, lse)


def _flash_bwd(scale, block_q, block_kv, softcap, res, d_out):
    q, k, v, q_pos, kv_pos, extras, out, lse = res
    pattern = _pattern(extras, softcap, k.shape[2])
    dq, grads, delta = _backward(q, q_pos, out, lse, d_out, k.shape[2], scale=scale, block_q=block_q, pattern=pattern)
    dq, dk, dv = grads(dq, k, v, kv_pos, block_kv)
    return (_unchunk(dq, q), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            _extras_grad(extras, pattern, lse, delta))


_flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------- all-gather K/V


def _gather(x, axis_name):
    """x [B, S/c, ...] (or a tree of such, e.g. `Tags`) gathered along the sequence."""
    return jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name, axis=1, tiled=True), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _all_gather_attention(q, k, v, q_pos, kv_pos, extras, axis_name, scale, block_q, block_kv, softcap, reach):
    return _all_gather_fwd(q, k, v, q_pos, kv_pos, extras, axis_name, scale, block_q, block_kv, softcap, reach)[0]


def _all_gather_fwd(q, k, v, q_pos, kv_pos, extras, axis_name, scale, block_q, block_kv, softcap, reach):
    pattern = _pattern(extras, softcap, k.shape[2])
    found = wn.plan_hops(reach, extras.window, axis_name, k.shape[1])

    def attend(k, v, kv_pos):
        return _forward(q, q_pos, k.shape[2], _single(k, v, kv_pos), scale=scale, block_q=block_q, block_kv=block_kv,
                        skip_masked_blocks=False, pattern=pattern)

    out, lse = wn.by_kind(
        reach, extras.window, found,
        lambda: attend(*wn.window_gather(k, v, kv_pos, axis_name, found, reach.balanced)),
        lambda: attend(_gather(k, axis_name), _gather(v, axis_name), _gather(kv_pos, axis_name)),
    )
    return out, (q, k, v, q_pos, kv_pos, extras, out, lse)  # the local K/V only: regathered in the backward


def _all_gather_bwd(axis_name, scale, block_q, block_kv, softcap, reach, res, d_out):
    q, k, v, q_pos, kv_pos, extras, out, lse = res
    pattern = _pattern(extras, softcap, k.shape[2])
    dq, grads, delta = _backward(q, q_pos, out, lse, d_out, k.shape[2], scale=scale, block_q=block_q, pattern=pattern)
    found = wn.plan_hops(reach, extras.window, axis_name, k.shape[1])

    def full():
        dq_all, dk_all, dv_all = grads(dq, _gather(k, axis_name), _gather(v, axis_name), _gather(kv_pos, axis_name),
                                       block_kv)
        # The transpose of the gather: every rank's contribution to each K/V shard, summed onto its owner.
        return (dq_all, *(jax.lax.psum_scatter(g, axis_name, scatter_dimension=1, tiled=True) for g in (dk_all, dv_all)))

    dq, dk, dv = wn.by_kind(
        reach, extras.window, found,
        lambda: wn.window_grads(dq, grads, q_pos, k, v, kv_pos, axis_name, found, reach.balanced, pattern.window, block_kv),
        full,
    )
    return (_unchunk(dq, q), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            _extras_grad(extras, pattern, lse, delta))


_all_gather_attention.defvjp(_all_gather_fwd, _all_gather_bwd)


def all_gather_attention_local(q, k, v, q_pos, kv_pos, *, axis_name, q_seg=None, kv_seg=None, scale=None,
                               block_q=DEFAULT_BLOCK, block_kv=DEFAULT_BLOCK, window=None, sinks=None, softcap=None,
                               reach=None):
    """Keeps this rank's queries, all-gathers K, V (Hkv heads only) and their positions (and
    segments) over `axis_name`; the backward re-gathers them and reduce-scatters dK, dV. With a
    `window.Reach` a sliding layer fetches only the pieces its window reaches (`window.py`)."""
    return _all_gather_attention(q, k, v, _tags(q_pos, q_seg), _tags(kv_pos, kv_seg), _extras(window, sinks), axis_name,
                                 scale, block_q, block_kv, softcap, wn.resolve(reach, window))


# ---------------------------------------------------------------- ring


def _ring_perm(axis_name):
    c = jax.lax.axis_size(axis_name)
    return c, [(i, (i + 1) % c) for i in range(c)]


def _ring_blocks(k, v, kv_pos, axis_name):
    """Step t folds the block of rank (r - t) mod c; c - 1 collective-permutes, none inside the cond."""
    c, perm = _ring_perm(axis_name)

    def run(fold, acc):
        def step(carry, _):
            acc, kv = carry
            # Send first: the permute does not depend on this step's work, so they may overlap.
            incoming = jax.lax.ppermute(kv, axis_name, perm)
            return (fold(acc, *kv), incoming), None

        (acc, kv), _ = jax.lax.scan(step, (acc, (k, v, kv_pos)), length=c - 1)
        return fold(acc, *kv)

    return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _ring_attention(q, k, v, q_pos, kv_pos, extras, axis_name, scale, block_q, block_kv, softcap, reach):
    return _ring_fwd(q, k, v, q_pos, kv_pos, extras, axis_name, scale, block_q, block_kv, softcap, reach)[0]


def _ring_fwd(q, k, v, q_pos, kv_pos, extras, axis_name, scale, block_q, block_kv, softcap, reach):
    found = wn.plan_hops(reach, extras.window, axis_name, k.shape[1])

    def attend(blocks):
        return _forward(q, q_pos, k.shape[2], blocks, scale=scale, block_q=block_q, block_kv=block_kv,
                        skip_masked_blocks=True, pattern=_pattern(extras, softcap, k.shape[2]))

    out, lse = wn.by_kind(
        reach, extras.window, found,
        lambda: attend(wn.window_blocks(k, v, kv_pos, axis_name, found, reach.balanced)),
        lambda: attend(_ring_blocks(k, v, kv_pos, axis_name)),
    )
    return out, (q, k, v, q_pos, kv_pos, extras, out, lse)


def _ring_bwd(axis_name, scale, block_q, block_kv, softcap, reach, res, d_out):
    """The K/V blocks go round the ring again, each with its dK/dV accumulator (fp32); after c
    steps (c - 1 permutes) one more permute of dK/dV alone brings each accumulator home. (A
    sliding layer with a `window.Reach`: its hops again, each piece's dK/dV sent back.)"""
    q, k, v, q_pos, kv_pos, extras, out, lse = res
    c, perm = _ring_perm(axis_name)
    pattern = _pattern(extras, softcap, k.shape[2])
    dq, grads, delta = _backward(q, q_pos, out, lse, d_out, k.shape[2], scale=scale, block_q=block_q, pattern=pattern)
    found = wn.plan_hops(reach, extras.window, axis_name, k.shape[1])

    def fold(dq, kv, dkv):
        def work(args):
            dq, dk, dv = args
            dq, dk_block, dv_block = grads(dq, *kv, block_kv)
            return dq, dk + dk_block, dv + dv_block

        skip = bw.all_masked(q_pos, kv[2], pattern.window)
        return jax.lax.cond(skip, lambda args: args, work, (dq, *dkv))

    def step(carry, _):
        dq, kv, dkv = carry
        dq, *dkv = fold(dq, kv, dkv)
        kv, dkv = jax.lax.ppermute((kv, tuple(dkv)), axis_name, perm)
        return (dq, kv, dkv), None

    def full():
        zeros = bw.varying(jnp.zeros(k.shape, bw.F32))
        (dq_all, kv, dkv), _ = jax.lax.scan(step, (dq, (k, v, kv_pos), (zeros, zeros)), length=c - 1)
        dq_all, *dkv = fold(dq_all, kv, dkv)
        return (dq_all, *jax.lax.ppermute(tuple(dkv), axis_name, perm))

    dq, dk, dv = wn.by_kind(
        reach, extras.window, found,
        lambda: wn.window_grads(dq, grads, q_pos, k, v, kv_pos, axis_name, found, reach.balanced, pattern.window, block_kv),
        full,
    )
    return (_unchunk(dq, q), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            _extras_grad(extras, pattern, lse, delta))


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(q, k, v, q_pos, kv_pos, *, axis_name, q_seg=None, kv_seg=None, scale=None,
                         block_q=DEFAULT_BLOCK, block_kv=DEFAULT_BLOCK, window=None, sinks=None, softcap=None, reach=None):
    """K/V blocks (with positions and segments) travel round the ranks of `axis_name` by
    `ppermute` while each rank keeps an online-softmax accumulator; blocks with nothing visible to
    this rank's queries (wholly after them, a window or more before them, or no segment in common)
    are skipped. With a `window.Reach` a sliding layer exchanges only with the ranks its window
    reaches (`window.py`); without one every block still travels."""
    return _ring_attention(q, k, v, _tags(q_pos, q_seg), _tags(kv_pos, kv_seg), _extras(window, sinks), axis_name,
                           scale, block_q, block_kv, softcap, wn.resolve(reach, window))


# ---------------------------------------------------------------- all-to-all (Ulysses)


def all_to_all_attention_local(q, k, v, q_pos, kv_pos, *, axis_name, q_seg=None, kv_seg=None, scale=None,
                               block_q=DEFAULT_BLOCK, block_kv=DEFAULT_BLOCK, window=None, sinks=None, softcap=None,
                               reach=None):
    """Swaps the sharded dimension from sequence to heads (all-to-all), attends over whole
    sequences for 1/c of the heads, swaps back. The local query head count must be divisible by
    c, the key/value head count divisible by c or a divisor of c: fewer KV heads than c are
    repeated (adjacent copies, so each rank's query heads still meet their own KV head) before
    the swap, as tensor parallelism does (the repeat's transpose sums dK, dV over the copies).
    The all-to-alls are linear: autodiff transposes them into all-to-alls."""
    del reach  # whole sequences per head group: nothing for a window to narrow
    c = jax.lax.axis_size(axis_name)
    hq, hkv = q.shape[2], k.shape[2]
    if hq % c or (hkv % c and c % hkv):
        raise ValueError(
            f"context attention all_to_all: {hq} query heads per device must be divisible by mesh.context={c}, "
            f"and {hkv} key/value heads divisible by it or a divisor of it; use impl ring or all_gather"
        )
    if hkv < c:
        k, v = jnp.repeat(k, c // hkv, axis=2), jnp.repeat(v, c // hkv, axis=2)

    def to_heads(x):  # [B, S/c, H, D] -> [B, S, H/c, D]; contiguous head groups keep GQA pairs together
        return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    if sinks is not None:  # this rank's contiguous group of query heads (`to_heads`)
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(axis_name) * (hq // c), hq // c)
    out = _flash_attention(
        to_heads(q), to_heads(k), to_heads(v), _gather(_tags(q_pos, q_seg), axis_name),
        _gather(_tags(kv_pos, kv_seg), axis_name), _extras(window, sinks), scale, block_q, block_kv, softcap,
    )
    return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)
