"""Sliding-window attention that computes only the band a window can reach.

A query sees at most `span` keys ending at itself (`span`: the model's sliding window, static; the
layer's own `window` ≤ span may be traced). With the sequence cut into tiles of span / `tiles` tokens,
query tile i needs only key tiles i − tiles .. i. `banded_attention` lays q out as [B · nt, tile]
rows and k, v as [B · nt, (tiles + 1) · tile] (each tile after the ones before it) and runs the full
kernel's fused forward and backward (`jaxpar.kernels.attention`, the backward recomputing the band's
probabilities from the log-sum-exp) with the band's mask: true positions, causal, within `window`,
within a document. Its scores are T · (1 + 1/tiles) · span instead of T · T. More tiles waste less of
the band on masked keys but make more, smaller matmuls.

It equals `patterned_attention` for any `window` in [1, span] (sinks, soft-capping and the scale
included); `patterned_or_banded` picks it per layer with `lax.cond`, so layers of both kinds still
run in one scan and only the sliding ones take the band.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.kernels import attention as full

TILES = 4  # tiles per span: the fastest at 8192 tokens and a 512 window (docs/attention_patterns.md)


def _tiled(x, tile: int):
    """x [B, T, ...] (T a multiple of tile) → [B · nt, tile, ...]."""
    b, t = x.shape[:2]
    return x.reshape(b * (t // tile), tile, *x.shape[2:])


def _with_previous(x, tile: int, reach: int):
    """x [B, T, ...] → [B · nt, (reach + 1) · tile, ...]: each tile after the `reach` before it (zeros
    before the first)."""
    b, t = x.shape[:2]
    nt = t // tile
    tiles = x.reshape(b, nt, tile, *x.shape[2:])
    padded = jnp.concatenate([jnp.zeros_like(tiles[:, :reach]), tiles], axis=1)
    band = jnp.concatenate([padded[:, i:i + nt] for i in range(reach + 1)], axis=2)
    return band.reshape(b * nt, (reach + 1) * tile, *x.shape[2:])


def banded_attention(q, k, v, segment_ids, window, span: int, sinks=None, softcap=None, scale=None, tiles: int = TILES):
    """Causal attention of q [B, T, H, D] over k, v [B, T, K, D] where each query sees the `window`
    (int32 scalar in [1, span], may be traced) tokens ending at itself, within its segment
    (`segment_ids` [B, T], 0: padding, whose output is 0; None: one sequence per row)."""
    tiles = max(1, min(tiles, span))
    tile = -(-span // tiles)
    b, t = q.shape[:2]
    pad = (-t) % tile
    segments = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if pad:
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, segments = widen(q), widen(k), widen(v), widen(segments)
    nt = (t + pad) // tile
    # True positions of each tile's queries and of its band's keys (the `tiles` tiles before, then its own).
    start = (jnp.arange(nt, dtype=jnp.int32) * tile)[:, None]
    query_at = jnp.tile(start + jnp.arange(tile, dtype=jnp.int32)[None], (b, 1))
    key_at = jnp.tile(start - tiles * tile + jnp.arange((tiles + 1) * tile, dtype=jnp.int32)[None], (b, 1))
    q_seg, k_seg = _tiled(segments, tile), _with_previous(segments, tile, tiles)
    distance = query_at[:, :, None] - key_at[:, None, :]
    window = jnp.asarray(window, jnp.int32)
    mask = (distance >= 0) & (distance < window) & (key_at[:, None, :] >= 0) & (q_seg[:, :, None] == k_seg[:, None, :])
    band = lambda x: _with_previous(x, tile, tiles)  # noqa: E731
    out = _band(_tiled(q, tile), band(k), band(v), q_seg, mask, sinks, softcap, scale)
    return out.reshape(b, t + pad, *out.shape[2:])[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _band(q, k, v, q_segments, mask, sinks, softcap, scale):
    return full._forward(q, k, v, q_segments, mask, sinks=sinks, softcap=softcap, scale=scale)[0]


def _band_fwd(q, k, v, q_segments, mask, sinks, softcap, scale):
    out, lse = full._forward(q, k, v, q_segments, mask, sinks=sinks, softcap=softcap, scale=scale)
    return out, (q, k, v, q_segments, mask, sinks, out, lse)


def _band_bwd(softcap, scale, residuals, d_out):
    q, k, v, q_segments, mask, sinks, out, lse = residuals
    dq, dk, dv, _, dsinks = full._backward(q, k, v, q_segments, out, lse, d_out, None, sinks, softcap, scale, mask=mask)
    return dq, dk, dv, None, None, dsinks


_band.defvjp(_band_fwd, _band_bwd)


def patterned_or_banded(q, k, v, segment_ids, window, span: int | None, sinks=None, softcap=None, scale=None):
    """`patterned_attention`, taking the band for a layer whose window is in [1, span]: a `lax.cond`
    on the (traced) window, so a scan over layers of both kinds runs each layer's own branch."""
    run_full = lambda q, k, v: full.patterned_attention(q, k, v, segment_ids, window, sinks, softcap, scale)  # noqa: E731
    if window is None or span is None or q.shape[1] <= 2 * span:  # little to skip at this length
        return run_full(q, k, v)
    window = jnp.asarray(window, jnp.int32)
    banded = lambda q, k, v: banded_attention(q, k, v, segment_ids, window, span, sinks, softcap, scale)  # noqa: E731
    return jax.lax.cond((window > 0) & (window <= span), banded, run_full, q, k, v)
