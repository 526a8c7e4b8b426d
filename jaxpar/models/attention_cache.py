"""Decoding with an attention pattern: each layer's cache is a ring, a sliding layer's only as long
as its window.

A layer's cache holds R slots. A full-attention layer's R is the whole cache (every slot the
sampler may write: `jaxpar.sampling`), a sliding layer's min(window, slots): slot s (the
sampler's position in a left-padded row) is kept at ring index s mod R, so a sliding layer's cache
stops growing once the window is full. With R = slots the ring is the plain cache (slot s at
index s), so one code path serves both kinds, and the window itself stays data (the layer's traced
`LayerWindow`) as in training.

A call of T new tokens written from slot `write_at` attends over the ring as it was (the slots
before write_at) and the T new keys, each key at its true slot, under the sampler's mask (padding,
causality) read at that slot, the window (query slot − key slot < W) and, as in training, the
sinks, soft-cap and score scale; then the last min(T, R) new keys are written into the ring. The
keys an earlier write would overwrite are still read in this call, so a prefill longer than the
window is exact too.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxpar.models.attention_pattern import _MASKED, Pattern, softmax_with_sinks


def held_slots(last, size: int):
    """[size]: the slot each ring index holds once slots .. `last` (traced) are written; negative:
    never written."""
    index = jnp.arange(size, dtype=jnp.int32)
    return last - jnp.mod(last - index, size)


def ring_attention(q, k_new, v_new, ring, write_at, mask, pattern: Pattern):
    """q [B, T, H, D] at slots write_at .. +T-1 over the ring (k, v [B, R, K, D]) and the new k, v
    [B, T, K, D]; `mask` [B, T, S] is the sampler's (True: visible) over all S slots. Returns (out
    [B, T, H, D], the ring with the new keys written)."""
    k_ring, v_ring = ring
    b, t, h, d = q.shape
    size, slots = k_ring.shape[1], mask.shape[-1]
    queries = write_at + jnp.arange(t, dtype=jnp.int32)
    keys = jnp.concatenate([held_slots(write_at - 1, size), queries])  # [R + T]
    visible = jnp.take(mask, jnp.clip(keys, 0, slots - 1), axis=2) & (keys >= 0)
    if pattern.window is not None:
        visible = visible & ((pattern.window <= 0) | (queries[:, None] - keys[None, :] < pattern.window))
    k = jnp.concatenate([k_ring.astype(q.dtype), k_new], axis=1)
    v = jnp.concatenate([v_ring.astype(q.dtype), v_new], axis=1)
    kv = k.shape[2]
    scale = d**-0.5 if pattern.scale is None else pattern.scale
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv, h // kv, d), k, preferred_element_type=jnp.float32) * scale
    if pattern.softcap is not None:
        s = pattern.softcap * jnp.tanh(s / pattern.softcap)
    s = jnp.where(visible[:, None, None], s, _MASKED)
    p = softmax_with_sinks(s, pattern.sinks)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    kept = min(t, size)
    index = jnp.mod(write_at + t - kept + jnp.arange(kept, dtype=jnp.int32), size)
    ring = tuple(c.at[:, index].set(new[:, t - kept :].astype(c.dtype)) for c, new in ((k_ring, k_new), (v_ring, v_new)))
    return out.reshape(b, t, h, d).astype(q.dtype), ring


def layer_runs(windows) -> list[tuple[bool, int, int, int]]:
    """Runs of consecutive layers of one kind: (sliding, first layer, stop layer, the run's first
    index into its kind's cache stack)."""
    runs, seen = [], [0, 0]
    for i, window in enumerate(windows):
        sliding = bool(window > 0)
        if runs and runs[-1][0] == sliding:
            runs[-1][2] += 1
        else:
            runs.append([sliding, i, i + 1, seen[sliding]])
        seen[sliding] += 1
    return [tuple(r) for r in runs]
