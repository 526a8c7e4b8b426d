"""YaRN, the RoPE context extension more than one family uses (gpt-oss; DeepSeek-V3 has its own
corrections on top, in `jaxpar.models.deepseek_v3.rope`), as transformers' `_compute_yarn_parameters`.

Frequencies whose wavelength exceeds the original context are divided by `factor`, those turning
more than `beta_fast` times over it are kept, and a linear ramp joins them over the rotary dims
between (`truncate`: the ramp's ends rounded out to whole dims, transformers' default; gpt-oss
keeps them fractional). The attention factor 0.1 · ln(factor) + 1 multiplies cos and sin, so
every score by its square.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(dim: int, base: float, factor: float, original: int, beta_fast: float = 32.0,
                             beta_slow: float = 1.0, truncate: bool = True) -> jnp.ndarray:
    """Per-pair rotation frequencies [dim / 2] of a rotary part of `dim` dims with YaRN."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))

    def correction_dim(rotations):  # the rotary dim that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp  # 1: the frequency as it is (short wavelengths); 0: divided by factor
    return inv_freq / factor * (1.0 - kept) + inv_freq * kept
