"""DeepSeek-V3's rotary embedding: only the decoupled `qk_rope_head_dim` part of each query and the
one RoPE key a token shares over its heads rotate; YaRN context extension with its two corrections;
DeepSeek's interleaved pairs.

YaRN (rope_type "yarn", transformers' `_compute_yarn_parameters`, `jaxpar.models.rope`): frequencies with wavelengths
beyond the original context are divided by `factor`, those shorter than `1 / beta_fast` of it kept,
a linear ramp between (over the rotary dims whose rotation counts over the original context fall
between `beta_fast` and `beta_slow`). Its attention factor scales cos and sin (so the RoPE part of
every score) by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and MLA's softmax scale
by mscale(factor, mscale_all_dim)², the whole score (transformers' `yarn_apply_mscale`).

`rope_interleave`: DeepSeek's weights lay each rotated pair out as adjacent dims (x0, x1), (x2,
x3), ...; the rotation reads the even dims then the odd ones and pairs dim i with i + R/2, as
`jaxpar.models.layers.apply_rope` does (transformers' `apply_rotary_pos_emb_interleave`). Queries
and keys come out in that order alike, so their dot products are the interleaved rotation's.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxpar.models.layers import apply_rope
from jaxpar.models.rope import yarn_inverse_frequencies, yarn_mscale


def is_yarn(cfg) -> bool:
    return cfg.rope_scaling.rope_type == "yarn"


def inverse_frequencies(cfg) -> jnp.ndarray:
    """Per-pair rotation frequencies [qk_rope_head_dim / 2] (default RoPE, or YaRN's)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    if not is_yarn(cfg):
        return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    s = cfg.rope_scaling
    return yarn_inverse_frequencies(dim, base, s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow)


def rotary_scale(cfg) -> float:
    """The factor YaRN applies to cos and sin (1 without YaRN)."""
    if not is_yarn(cfg):
        return 1.0
    s = cfg.rope_scaling
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_scale(cfg) -> float:
    """The attention scores' scale: 1 / sqrt(qk head dim), times mscale(factor, mscale_all_dim)² with YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if is_yarn(cfg) and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def rotate(x, positions, inv_freq, cfg):
    """x [B, S, heads, qk_rope_head_dim] rotated by position (interleaved pairs read as even dims
    then odd ones), times YaRN's rotary scale."""
    if cfg.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    out = apply_rope(x, positions, inv_freq)
    scale = rotary_scale(cfg)
    return out if scale == 1.0 else (out.astype(jnp.float32) * scale).astype(x.dtype)
