"""Flash-attention style kernels on one device: a query block attends to one key/value block.

Everything here is local (no collectives), so the ring / all-gather / all-to-all wrappers can call it
once per key/value block they hold. Queries and keys are cut into chunks (`block_q`, `block_kv`) so
the largest score array is [B, Hkv, G, block_q, block_kv] whatever the sequence length. What the
mask reads of each token travels with it as `Tags`: its true position and, for packed documents,
its segment id. The mask is `kv_pos <= q_pos` (and, with segments, the same segment, never
padding), never from array indices, so any sequence order (e.g. the load-balanced one) works. A
chunk pair with nothing visible is skipped by `lax.cond` (no collective inside the branches):
every key position after every query position, or (packed documents) no segment in common, told
by the ranges of segment ids — sound for any labelling, since disjoint ranges share no id.

A layer's attention pattern (`jaxpar.models.attention_pattern`) travels as `Pattern`: a causal
sliding window (`window`, int32, 0 = full: a key is visible only when `q_pos - kv_pos < window`,
from true positions, so it never depends on the sequence order and never crosses a document,
whose segment mask still applies), logit soft-capping (`softcap`) and per-head sinks (`sinks`
[Hkv, G]: one extra logit in each softmax's denominator, folded in once, by `finalize`, after every
key block). Chunk pairs whose keys all lie a window or more before every query are skipped too.

Layout: the GQA group G = Hq / Hkv is split out of the query heads, q [B, S, Hkv, G, D]. Softmax
statistics, outputs and gradients accumulate in fp32; matmul inputs stay in the input dtype
(`preferred_element_type=float32`), as flash attention does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class Tags(NamedTuple):
    """What the mask reads of a run of tokens: true positions pos [B or 1, S] (one row: shared by
    every row) and segment ids seg [B, S] of packed documents (None: one sequence per row; 0:
    padding, which sees nothing and is never seen)."""

    pos: jax.Array
    seg: jax.Array | None = None


class Pattern(NamedTuple):
    """One layer's attention pattern: window int32 scalar (0: full causal; None: no window op at
    all), softcap a Python float (None: no cap), sinks fp32 [Hkv, G] (None: no sinks)."""

    window: jax.Array | None = None
    softcap: float | None = None
    sinks: jax.Array | None = None


NO_PATTERN = Pattern()


def split_tags(tags: Tags, size: int) -> Tags:
    return jax.tree.map(lambda x: split_chunks(x, size), tags)


class Accumulator(NamedTuple):
    """Online-softmax state per query chunk: output sum o [nq, B, Hkv, G, cq, D], running max m
    and running sum l [nq, B, Hkv, G, cq] (all fp32)."""

    o: jax.Array
    m: jax.Array
    l: jax.Array


def chunk_size(length: int, limit: int) -> int:
    """Largest divisor of half of `length` (of `length` if odd) that is at most `limit`: the two
    halves of a rank's tokens are two separate pieces in the load-balanced layout, and chunks
    that never straddle them let the fully masked piece pairs be skipped (one chunk over both
    pieces would do twice the causal work). Lengths with few divisors give small chunks."""
    whole = length // 2 if length % 2 == 0 else length
    for size in range(min(whole, max(limit, 1)), 0, -1):
        if whole % size == 0:
            return size
    return 1


def varying(x):
    """`x` marked varying over every manual mesh axis. Zeros made inside a shard_map start
    invariant, but the accumulators they start become varying after one block of work, and a
    scan carry or the two branches of a cond must agree (check_vma). jax 0.10.2 has no public
    getter for one value's varying axes, so use all manual axes: the attention inputs vary over
    all of them in every caller (context, heads, and the pipeline axis in the pipeline engine)."""
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def split_chunks(x, size: int, axis: int = 1):
    """[..., S, ...] -> [S/size, ..., size, ...]: the chunk index moves to the front."""
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def merge_chunks(x, axis: int = 1):
    """Inverse of `split_chunks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _segment_range(seg):
    """(lowest, highest) real segment id per row of seg [B, S]; (int max, 0) for all padding."""
    real = seg > 0
    return jnp.min(jnp.where(real, seg, jnp.iinfo(seg.dtype).max), axis=1), jnp.max(jnp.where(real, seg, 0), axis=1)


def all_masked(q: Tags, kv: Tags, window=None):
    """True when no query (any batch row) may see any key: the block's work can be skipped."""
    later = jnp.min(kv.pos, axis=1) > jnp.max(q.pos, axis=1)  # [B or 1]
    if window is not None:  # every key a window or more before every query
        later = later | ((window > 0) & (jnp.min(q.pos, axis=1) - jnp.max(kv.pos, axis=1) >= window))
    if q.seg is None:
        return jnp.all(later)
    (q_low, q_high), (kv_low, kv_high) = _segment_range(q.seg), _segment_range(kv.seg)
    apart = (kv_high < q_low) | (kv_low > q_high)  # no id in common (also: a side all padding)
    return jnp.all(later | apart)


def _logits(q, k, scale, softcap):
    """Scaled, soft-capped (if asked) scores [B, Hkv, G, cq, ck] in fp32, unmasked."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=F32) * scale
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _scores(q, k, q_tags: Tags, kv_tags: Tags, scale, pattern: Pattern = NO_PATTERN):
    """Masked scores [B, Hkv, G, cq, ck] in fp32 (-inf where the key is not visible)."""
    s = _logits(q, k, scale, pattern.softcap)
    visible = kv_tags.pos[:, None, None, None, :] <= q_tags.pos[:, None, None, :, None]
    if pattern.window is not None:
        distance = q_tags.pos[:, None, None, :, None] - kv_tags.pos[:, None, None, None, :]
        visible = visible & ((pattern.window <= 0) | (distance < pattern.window))
    if q_tags.seg is not None:
        q_seg = q_tags.seg[:, None, None, :, None]
        visible = visible & (kv_tags.seg[:, None, None, None, :] == q_seg) & (q_seg != 0)
    return jnp.where(visible, s, -jnp.inf)


def init_accumulator(q_chunks):
    """Empty state for q_chunks [nq, B, cq, Hkv, G, D]."""
    nq, b, cq, hkv, g, d = q_chunks.shape
    o = jnp.zeros((nq, b, hkv, g, cq, d), F32)
    m = jnp.full((nq, b, hkv, g, cq), -jnp.inf, F32)
    l = jnp.zeros((nq, b, hkv, g, cq), F32)
    return Accumulator(*(varying(x) for x in (o, m, l)))


def _update(acc: Accumulator, q, k, v, q_pos, kv_pos, scale, pattern: Pattern) -> Accumulator:
    """One query chunk × one key chunk of the online softmax."""
    s = _scores(q, k, q_pos, kv_pos, scale, pattern)
    m_new = jnp.maximum(acc.m, jnp.max(s, axis=-1))
    # A row that has seen no visible key yet keeps m = -inf; shift by 0 there so exp gives 0, not NaN.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(acc.m - m_safe)
    pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=F32)
    return Accumulator(alpha[..., None] * acc.o + pv, m_new, alpha * acc.l + jnp.sum(p, axis=-1))


def forward_block(acc: Accumulator, q_chunks, qpos_chunks, k, v, kv_pos, *, scale, block_kv,
                  pattern: Pattern = NO_PATTERN) -> Accumulator:
    """Folds one key/value block (k, v [B, Sk, Hkv, D], its `Tags` kv_pos) into the accumulator of
    the query chunks q_chunks [nq, B, cq, Hkv, G, D] (their `Tags` qpos_chunks, chunked [nq, ...])."""
    ck = chunk_size(k.shape[1], block_kv)
    kv = (split_chunks(k, ck), split_chunks(v, ck), split_tags(kv_pos, ck))

    def one_query_chunk(args):
        acc_i, q_i, qpos_i = args

        def one_key_chunk(a, kv_j):
            k_j, v_j, kvpos_j = kv_j
            a = jax.lax.cond(
                all_masked(qpos_i, kvpos_j, pattern.window),
                lambda a: a,
                lambda a: _update(a, q_i, k_j, v_j, qpos_i, kvpos_j, scale, pattern),
                a,
            )
            return a, None

        return jax.lax.scan(one_key_chunk, acc_i, kv)[0]

    return jax.lax.map(one_query_chunk, (acc, q_chunks, qpos_chunks))


def finalize(acc: Accumulator, sinks=None):
    """Output chunks [nq, B, cq, Hkv, G, D] (fp32) and log-sum-exp [nq, B, Hkv, G, cq].
    A row that saw no key at all gets output 0 and lse +inf (its backward terms are then 0); with
    `sinks` [Hkv, G] each row's denominator gains exp(sink) (such a row: output 0, lse = sink)."""
    if sinks is not None:
        sink = sinks.astype(F32)[None, None, :, :, None]
        m = jnp.maximum(acc.m, sink)
        alpha = jnp.exp(acc.m - m)  # 0 where nothing was seen (m = -inf)
        acc = Accumulator(alpha[..., None] * acc.o, m, alpha * acc.l + jnp.exp(sink - m))
    seen = acc.l > 0
    o = acc.o / jnp.where(seen, acc.l, 1.0)[..., None]
    lse = jnp.where(seen, acc.m + jnp.log(jnp.where(seen, acc.l, 1.0)), jnp.inf)
    return jnp.moveaxis(o, -2, 2), lse


def sink_grads(sinks, lse, delta):
    """d loss / d sinks [Hkv, G] fp32 for this rank's queries: d out / d sink = −p_sink · out, so it
    is −Σ p_sink · delta over every query row (lse, delta [nq, B, Hkv, G, cq])."""
    p_sink = jnp.exp(sinks.astype(F32)[None, None, :, :, None] - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 1, 4))


def backward_block(dq_chunks, q_chunks, qpos_chunks, do_chunks, lse, delta, k, v, kv_pos, *, scale, block_kv,
                   pattern: Pattern = NO_PATTERN):
    """Gradient contributions of one key/value block, recomputing its scores chunk by chunk.
    Inputs as in `forward_block`, plus the output cotangent do_chunks (layout of q_chunks), the
    forward's lse and delta = rowsum(do · o) [nq, B, Hkv, G, cq]. Returns (dq_chunks + this
    block's part, dk, dv) with dk / dv [B, Sk, Hkv, D] fp32 for this block only."""
    ck = chunk_size(k.shape[1], block_kv)
    kv = (split_chunks(k, ck), split_chunks(v, ck), split_tags(kv_pos, ck))

    def one_key_chunk(dq_all, kv_j):
        k_j, v_j, kvpos_j = kv_j
        zeros = jnp.zeros(k_j.shape, F32)
        dkv0 = (varying(zeros), varying(zeros))

        def one_query_chunk(dkv, per_q):
            dq_i, q_i, qpos_i, do_i, lse_i, delta_i = per_q

            def work(dkv, dq_i):
                dk_j, dv_j = dkv
                s = _scores(q_i, k_j, qpos_i, kvpos_j, scale, pattern)
                p = jnp.exp(s - lse_i[..., None])
                dv_j = dv_j + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do_i.dtype), do_i, preferred_element_type=F32)
                dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=F32)
                ds = p * (dp - delta_i[..., None]) * scale
                if pattern.softcap is not None:  # d(cap · tanh(x / cap)) / dx = 1 − tanh²; masked: p = 0
                    ds = ds * (1.0 - jnp.square(_logits(q_i, k_j, scale, pattern.softcap) / pattern.softcap))
                dq_i = dq_i + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k_j.dtype), k_j, preferred_element_type=F32)
                dk_j = dk_j + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q_i.dtype), q_i, preferred_element_type=F32)
                return (dk_j, dv_j), dq_i

            return jax.lax.cond(
                all_masked(qpos_i, kvpos_j, pattern.window), lambda dkv, dq_i: (dkv, dq_i), work, dkv, dq_i
            )

        per_q = (dq_all, q_chunks, qpos_chunks, do_chunks, lse, delta)
        (dk_j, dv_j), dq_all = jax.lax.scan(one_query_chunk, dkv0, per_q)
        return dq_all, (dk_j, dv_j)

    dq_chunks, (dk, dv) = jax.lax.scan(one_key_chunk, dq_chunks, kv)
    return dq_chunks, merge_chunks(dk), merge_chunks(dv)
