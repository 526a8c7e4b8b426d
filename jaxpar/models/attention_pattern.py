"""A layer's attention pattern: sliding windows, attention sinks, logit soft-capping, the score scale.

Recent families do not attend over the whole sequence in every layer: gpt-oss alternates
sliding-window layers with full ones and adds learned per-head sinks, Gemma 2 / 3 soft-cap their
logits and scale queries by `query_pre_attn_scalar`. These are `config.model` keys of those
families (named as in their transformers configs); this module is the one place that reads them.
A family opts in by adding `option_keys()` to its schema (no key here belongs to Llama's, so every
family without them is unchanged, bit for bit) and `MEANINGS` to the documented keys.

- `sliding_window`: W tokens (None: no sliding layers). A key is visible to a query at most W - 1
  tokens after it (transformers' sliding-window causal mask: the query and the W - 1 before it),
  within the query's own document (the segment mask still applies, so a window never crosses a
  document), computed from true positions, so any sequence order (context parallelism's load
  balancing) gives the same mask.
- `layer_types`: one "sliding_attention" / "full_attention" per layer, as transformers spells it;
  empty: every layer sliding when `sliding_window` is set, else full.
- `attention_sinks` (jaxpar's own key; gpt-oss always has them): a learned logit per query head
  (parameter `sinks`, logical axis `heads`, so it shards over `tensor` with the heads) added to
  each softmax's denominator with no value: softmax over [scores, sink], the sink's column dropped.
- `attn_logit_softcapping`: logits = cap · tanh(logits / cap) before the mask (None: off).
- `query_pre_attn_scalar`: the score scale is its −½ power instead of head_dim's (None: head_dim).

Layers of different kinds still run in one scan: the pattern is data, `layer_windows(model)` one
int per layer (0: full), scanned with the layers, and every attention path takes the window as an
int32 scalar that may be traced. `Pattern` is what one layer's call receives; `attend` runs it on
one device for each `parallel.attention_impl`: "xla" by `xla_attention` below (autodiff of the
definition), "jaxpar_xla" by the hand-written kernel (`jaxpar.kernels.attention.patterned_attention`),
whose sliding layers compute only the band their window reaches (`jaxpar.kernels.local_attention`);
"cudnn" by `fused_attention` where cuDNN can express the pattern (`cudnn_expresses`: a window, a
scale, documents), else, with sinks or soft-capping (which `jax.nn.dot_product_attention` lacks),
by the XLA path, said once per trace in a log line. Context parallelism: `jaxpar.parallel.context.local`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections.config_dict import placeholder

from jaxpar.kernels.local_attention import patterned_or_banded

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
SIXTEEN_BITS = (jnp.bfloat16, np.float16)

MEANINGS = {
    "sliding_window": "tokens a sliding-window layer attends over (the query and the ones before it, within its "
    "document); None: no sliding layers",
    "layer_types": "one of sliding_attention / full_attention per layer; empty: every layer sliding when "
    "sliding_window is set, else full",
    "attention_sinks": "a learned logit per query head in each softmax's denominator (gpt-oss's sinks)",
    "attn_logit_softcapping": "attention logits become cap · tanh(logits / cap); None: not capped",
    "query_pre_attn_scalar": "the attention scores are scaled by its -1/2 power; None: by head_dim's",
}


def option_keys() -> dict:
    """The keys (with defaults that change nothing) a family adds to its schema to opt in."""
    return dict(
        sliding_window=placeholder(int),
        layer_types=[],
        attention_sinks=False,
        attn_logit_softcapping=placeholder(float),
        query_pre_attn_scalar=placeholder(float),
    )


def _get(model, key, default=None):
    # `in`, not ConfigDict.get (whose miss builds a did-you-mean message: slow in the planner).
    return model[key] if key in model else default


def layer_kinds(model) -> list[str]:
    """Each layer's kind: `layer_types`; empty: every `sliding_window_pattern`-th layer full and the
    others sliding where the family has that key (Gemma 2 / 3, as their transformers configs derive
    it), else every layer sliding when `sliding_window` is set, else full."""
    window, types = _get(model, "sliding_window"), list(_get(model, "layer_types", []) or [])
    if types:
        return types
    period = _get(model, "sliding_window_pattern")
    if window and period:
        return [SLIDING if (i + 1) % period else FULL for i in range(model.num_hidden_layers)]
    return [SLIDING if window else FULL] * model.num_hidden_layers


def layer_windows(model) -> np.ndarray:
    """int32 [num_hidden_layers]: each layer's window (0: full attention)."""
    window, types = _get(model, "sliding_window"), layer_kinds(model)
    return np.asarray([window if kind == SLIDING and window else 0 for kind in types], np.int32)


def ranges(model) -> list[str]:
    """One line per problem with the pattern keys (none when the family has not opted in)."""
    errors = []
    window, types = _get(model, "sliding_window"), list(_get(model, "layer_types", []) or [])
    if window is not None and window < 1:
        errors.append(f"model.sliding_window={window} must be >= 1 (or None: no sliding layers)")
    if types and len(types) != model.num_hidden_layers:
        errors.append(f"model.layer_types has {len(types)} entries; model.num_hidden_layers={model.num_hidden_layers}")
    unknown = sorted({t for t in types} - {SLIDING, FULL})
    if unknown:
        errors.append(f"model.layer_types: {unknown} are not {SLIDING!r} or {FULL!r}")
    if SLIDING in types and window is None:
        errors.append("model.layer_types names sliding_attention layers but model.sliding_window is None")
    # Each layer's window is a float leaf of the layer stack (`jaxpar.models.attention_layers`),
    # cast to the compute dtype inside pipeline stages: it must survive 16-bit floats exactly.
    if window is not None and window >= 1 and not all(float(np.asarray(window, dt)) == window for dt in SIXTEEN_BITS):
        errors.append(f"model.sliding_window={window} is not exact in bfloat16 and float16 (use a power of two, or a "
                      "number of at most 8 significant bits below 65504)")
    for key in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        value = _get(model, key)
        if value is not None and value <= 0:
            errors.append(f"model.{key}={value} must be > 0 (or None)")
    return errors


class Pattern(NamedTuple):
    """One layer's call: window int32 scalar (0: full; may be traced) or None (no window op), sinks
    [H] or None, softcap and scale Python floats or None (no cap; 1/√head_dim); span the model's
    `sliding_window`, static (None: none), the band the jaxpar_xla path computes for sliding layers."""

    window: jax.Array | int | None = None
    sinks: jax.Array | None = None
    softcap: float | None = None
    scale: float | None = None
    span: int | None = None


PLAIN = Pattern()


def static_pattern(model) -> Pattern:
    """The static parts of a model's pattern (soft-cap, scale, span), the window and sinks left empty."""
    scalar, cap, window = _get(model, "query_pre_attn_scalar"), _get(model, "attn_logit_softcapping"), _get(model, "sliding_window")
    return Pattern(softcap=None if cap is None else float(cap), scale=None if scalar is None else float(scalar) ** -0.5,
                   span=int(window) if window else None)


def is_plain(pattern: Pattern | None) -> bool:
    """Nothing but causal (and document) masking: the existing kernels run, unchanged."""
    return pattern is None or all(part is None for part in pattern)


_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row gives no NaN


def softmax_with_sinks(s, sinks):
    """Softmax of masked fp32 scores [B, K, G, T, S] over keys, with one more logit per query head
    (`sinks` [H] = [K·G], or None) in each denominator and no value."""
    if sinks is None:
        return jax.nn.softmax(s, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, *s.shape[1:3], 1, 1), s.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]


def xla_attention(q, k, v, segment_ids=None, pattern: Pattern = PLAIN):
    """The definition, differentiated by autodiff (`parallel.attention_impl` = xla): q [B, T, H, D]
    over k, v [B, T, K, D] in text order; padding rows (segment 0) give 0."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    scale = d**-0.5 if pattern.scale is None else pattern.scale
    qg = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if pattern.softcap is not None:
        s = pattern.softcap * jnp.tanh(s / pattern.softcap)
    row = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
    visible = col <= row
    if pattern.window is not None:
        visible = visible & ((pattern.window <= 0) | (row - col < pattern.window))
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
    s = jnp.where(visible, s, _MASKED)
    p = softmax_with_sinks(s, pattern.sinks)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, t, h, d).astype(q.dtype)
    if segment_ids is None:
        return out
    return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def fused_attention(q, k, v, implementation: str, segment_ids=None, scale: float | None = None, window: int | None = None):
    """`jax.nn.dot_product_attention` (implementation xla or cudnn), causal, q [B, T, H, D] over k, v
    [B, T, K, D] in text order: scale None is 1/√D; a static `window` W (None: full) is its
    `local_window_size` (W - 1, 0), the query and the W - 1 keys before it (cuDNN's
    `sliding_window_length` W); `segment_ids` [B, T] a [B, 1, T, T] block-diagonal mask beside
    them (cuDNN adds it as a bias) and 0 on padding rows (segment 0), so nothing flows back through them."""
    same = None if segment_ids is None else segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    out = jax.nn.dot_product_attention(q, k, v, mask=same, scale=scale, is_causal=True,
                                       local_window_size=None if window is None else (window - 1, 0), implementation=implementation)
    if segment_ids is None:
        return out
    return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def cudnn_expresses(pattern: Pattern) -> bool:
    """cuDNN's fused kernel runs the pattern: a window, a scale and documents, but no sinks or soft-cap."""
    return pattern.sinks is None and pattern.softcap is None


def cudnn_runs(model) -> bool:
    """cuDNN's kernel runs every layer of the model: no sinks and no soft-cap (the cost model's fact)."""
    return not _get(model, "attention_sinks", False) and _get(model, "attn_logit_softcapping") is None


def cudnn_attention(q, k, v, segment_ids=None, pattern: Pattern = PLAIN):
    """cuDNN for a pattern it expresses (`cudnn_expresses`), whose window cuDNN takes as a static
    number: a layer's traced window is 0 or the model's `span` (no span: 0), so a `lax.cond` picks
    one of the two static kernels (a scan over layers of both kinds runs each layer's own)."""
    window, scale = pattern.window, pattern.scale
    if window is None or isinstance(window, int) or pattern.span is None:
        static = window if isinstance(window, int) and window > 0 else None
        return fused_attention(q, k, v, "cudnn", segment_ids, scale, static)
    return jax.lax.cond(window > 0, lambda: fused_attention(q, k, v, "cudnn", segment_ids, scale, pattern.span),
                        lambda: fused_attention(q, k, v, "cudnn", segment_ids, scale))


def attend(q, k, v, implementation: str, segment_ids=None, pattern: Pattern = PLAIN):
    """One device, a patterned layer: the implementation's path (see the module docstring)."""
    if implementation == "jaxpar_xla":  # sliding layers on the band of their span (jaxpar.kernels.local_attention)
        return patterned_or_banded(q, k, v, segment_ids, pattern.window, pattern.span, pattern.sinks, pattern.softcap,
                                   pattern.scale)
    if implementation == "cudnn":
        if cudnn_expresses(pattern):
            return cudnn_attention(q, k, v, segment_ids, pattern)
        log.info("parallel.attention_impl=cudnn: a layer with attention sinks or logit soft-capping takes the XLA path "
                 "(jax.nn.dot_product_attention has neither)")
    return xla_attention(q, k, v, segment_ids, pattern)

