"""Causal grouped-query attention with a hand-written backward, laid out for plain XLA.

`causal_attention(q [B, T, H, D], k, v [B, S, K, D], segment_ids=None) -> [B, T, H, D]` computes
softmax(q kᵀ / √D, causal) v like `jax.nn.dot_product_attention(..., is_causal=True)` (its XLA
path), with fewer passes over the [B, H, T, S] scores:
  - the G = H / K query heads that share a KV head are one batched matmul of G·T rows (no
    repeated k/v, no vmap over groups),
  - the scale is applied to q ([T, D]) instead of the scores ([T, S]), the causal mask is an
    iota comparison fused into the max/exp, and the output is normalised after P·V ([T, D]),
  - the backward (`jax.custom_vjp`) keeps only q, k, v, the output and the log-sum-exp [B, H, T]
    and recomputes the probabilities in one fused pass — the flash-attention backward without
    tiling: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = dS K, dK = dSᵀ Q.
Softmax statistics are fp32 whatever the input dtype (as jax's XLA path does). Compared with
`jax.nn.dot_product_attention` by `tests/kernels/test_cpu_kernels.py`.

Packed documents (`segment_ids` [B, T], T = S, int; 0 marks padding): a query sees only earlier keys
of its own segment. A padding query sees nothing: its output is 0, and its output gradient is
dropped in the backward, so it adds nothing to dK, dV (its masked scores stay finite: no NaN).

`patterned_attention(q, k, v, segment_ids, window, sinks, softcap, scale)` adds a layer's attention
pattern (`jaxpar.models.attention_pattern`): a causal sliding window (a key at most `window` - 1
tokens before the query; an int32 scalar, possibly traced, 0 = full), learned per-head sinks (one
extra logit per query head in each softmax's denominator, with no value), logit soft-capping
(cap · tanh(logits / cap)) and the score scale. Its backward adds the sinks' gradient,
−Σ p_sink · rowsum(dO ∘ O), and the soft-cap's factor 1 − (capped / cap)². No key blocks to skip:
this kernel is not tiled, the window is a mask.

`masked_attention(q, k, v, mask [B, T, S])` is the same forward with an explicit mask instead of
the causal one: the decode path (`jaxpar.sampling`) attends over a KV cache whose valid slots
differ per row (left padding). Forward only; proven by the cached-vs-full-forward logits of
`tests/sampling/test_sampling.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Large negative logit for masked positions (finite, so fully-masked rows cannot produce NaN).
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def _grouped(q, k):
    """q [B, T, H, D] → [B, K, G, T, D] (query heads that share KV head k together)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    return q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)


def _logits(qg, k, softcap=None):
    """fp32 logits [B, K, G, T, S] of scaled grouped queries and k [B, S, K, D], soft-capped if asked."""
    s = jnp.einsum("bkgtd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _scores(qg, k, segment_ids=None, mask=None, window=None, softcap=None):
    """Masked fp32 scores [B, K, G, T, S] from scaled grouped queries and k [B, S, K, D]; `mask`
    [B, T, S] (True: attend) replaces the causal and segment masks when given; `window` (int32
    scalar, 0: full) keeps only keys less than `window` tokens before the query."""
    s = _logits(qg, k, softcap)
    if mask is not None:
        return jnp.where(mask[:, None, None], s, _MASKED)
    t, length = s.shape[-2], s.shape[-1]
    row = jax.lax.broadcasted_iota(jnp.int32, (t, length), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (t, length), 1)
    visible = col <= row  # jax's causal mask: tril of [T, S]
    if window is not None:
        visible = visible & ((window <= 0) | (row - col < window))
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
    return jnp.where(visible, s, _MASKED)


def _real_rows(x, segment_ids):
    """x [B, T, ...] with the rows of padding queries (segment 0) set to 0."""
    if segment_ids is None:
        return x
    keep = (segment_ids != 0).reshape(segment_ids.shape + (1,) * (x.ndim - 2))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _grouped_sinks(sinks, k):
    """Per-query-head sinks [H] -> [1, K, G, 1, 1] fp32 (broadcasts against [B, K, G, T, S])."""
    kv = k.shape[2]
    return sinks.astype(jnp.float32).reshape(1, kv, -1, 1, 1)


def _forward(q, k, v, segment_ids=None, mask=None, window=None, sinks=None, softcap=None, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qg = _grouped(q * jnp.asarray(scale, q.dtype), k)
    s = _scores(qg, k, segment_ids, mask, window, softcap)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:  # the sink is one more logit of the softmax, with no value
        sink = _grouped_sinks(sinks, k)
        m = jnp.maximum(m, sink)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    out = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / l
    lse = (m + jnp.log(l))[..., 0]  # [B, K, G, T]
    b, t, h, d = q.shape
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
    return _real_rows(out, segment_ids), lse


def masked_attention(q, k, v, mask):
    """q [B, T, H, D] over k, v [B, S, K, D] where `mask` [B, T, S] is True (forward only)."""
    return _forward(q, k, v, mask=mask)[0]


@jax.custom_vjp
def causal_attention(q, k, v, segment_ids=None):
    return _forward(q, k, v, segment_ids)[0]


def _attention_fwd(q, k, v, segment_ids=None):
    out, lse = _forward(q, k, v, segment_ids)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    return _backward(q, k, v, segment_ids, out, lse, d_out)[:4]


def _backward(q, k, v, segment_ids, out, lse, d_out, window=None, sinks=None, softcap=None, scale=None, mask=None):
    """(dq, dk, dv, None, dsinks or None); `mask` as `_forward`'s (`jaxpar.kernels.local_attention`'s band)."""
    d_out = _real_rows(d_out, segment_ids)  # padding rows' outputs are constant 0
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qg = _grouped(q * jnp.asarray(scale, q.dtype), k)
    p = jnp.exp(_scores(qg, k, segment_ids, mask, window, softcap) - lse[..., None])  # [B, K, G, T, S] fp32
    d_out_g = _grouped(d_out, k)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, H]
    delta = _grouped(delta[..., None], k)[..., 0]  # [B, K, G, T]
    dv = jnp.einsum("bkgts,bkgtd->bskd", p.astype(v.dtype), d_out_g, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgtd,bskd->bkgts", d_out_g, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if softcap is not None:  # d(cap · tanh(x / cap)) / dx = 1 - tanh² (masked entries have p = 0)
        ds = ds * (1.0 - jnp.square(_logits(qg, k, softcap) / softcap))
    ds = ds.astype(q.dtype)
    dqg = jnp.einsum("bkgts,bskd->bkgtd", ds, k, preferred_element_type=jnp.float32) * scale
    dk = jnp.einsum("bkgts,bkgtd->bskd", ds, qg, preferred_element_type=jnp.float32)
    b, t, h, d = q.shape
    dq = dqg.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    dsinks = None
    if sinks is not None:  # d out / d sink = -p_sink · out, so d loss / d sink = -Σ p_sink · delta
        p_sink = jnp.exp(_grouped_sinks(sinks, k)[..., 0] - lse)  # [B, K, G, T]
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 3))).reshape(sinks.shape).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks


causal_attention.defvjp(_attention_fwd, _attention_bwd)


def patterned_attention(q, k, v, segment_ids=None, window=None, sinks=None, softcap=None, scale=None):
    """`causal_attention` with a layer's attention pattern (see the module docstring): `window`
    an int32 scalar (0: full; may be traced, e.g. scanned per layer) or None, `sinks` [H] or None,
    `softcap` and `scale` Python floats or None (None: no cap, 1/√D)."""
    window = None if window is None else jnp.asarray(window, jnp.int32)
    return _patterned(q, k, v, segment_ids, window, sinks, softcap, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _patterned(q, k, v, segment_ids, window, sinks, softcap, scale):
    return _forward(q, k, v, segment_ids, None, window, sinks, softcap, scale)[0]


def _patterned_fwd(q, k, v, segment_ids, window, sinks, softcap, scale):
    out, lse = _forward(q, k, v, segment_ids, None, window, sinks, softcap, scale)
    return out, (q, k, v, segment_ids, window, sinks, out, lse)


def _patterned_bwd(softcap, scale, residuals, d_out):
    q, k, v, segment_ids, window, sinks, out, lse = residuals
    dq, dk, dv, _, dsinks = _backward(q, k, v, segment_ids, out, lse, d_out, window, sinks, softcap, scale)
    return dq, dk, dv, None, None, dsinks


_patterned.defvjp(_patterned_fwd, _patterned_bwd)
