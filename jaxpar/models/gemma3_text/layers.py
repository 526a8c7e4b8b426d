"""Gemma 3's pieces: its RMSNorm (scale 1 + weight, the weight stored as transformers stores it, 0
at init), QK-norm with that norm, the GeGLU MLP (tanh GELU) and the block with four norms (before
and after attention, before and after the MLP: the "sandwich"), as transformers' Gemma3 modules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model_facts import head_dim_of
from jaxpar.models.attention_layers import PatternedAttention
from jaxpar.models.layers import MLP
from jaxpar.models.options import RunOptions
from jaxpar.sharding import RESIDUAL, constrain


class GemmaRMSNorm(nnx.Module):
    """x / rms(x) · (1 + weight), in fp32, cast back to x's dtype (Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32), out_sharding=("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3Attention(PatternedAttention):
    """The patterned attention with a Gemma RMSNorm over each head's q and k before RoPE."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.q_norm = GemmaRMSNorm(head_dim_of(cfg), cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim_of(cfg), cfg.rms_norm_eps)

    def project_qkv(self, x, opts: RunOptions):
        q, k, v = super().project_qkv(x, opts)
        return self.q_norm(q), self.k_norm(k), v


class GeGLU(MLP):
    """gelu_tanh(x · gate) ∘ (x · up), then down: the SwiGLU's layout with tanh GELU."""

    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class Gemma3Block(nnx.Module):
    """x + post_attention_norm(attention(input_norm(x))), then the same around the MLP."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, make_attention, make_mlp):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = GemmaRMSNorm(d, eps)
        self.attention = make_attention(cfg, rngs=rngs)
        self.post_attention_norm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_norm = GemmaRMSNorm(d, eps)
        self.mlp = make_mlp(cfg, rngs=rngs)
        self.post_feedforward_norm = GemmaRMSNorm(d, eps)

    def _feed_forward(self, x, opts: RunOptions):
        out, aux = self.mlp(self.pre_feedforward_norm(x), opts)
        return constrain(opts.rules, x + self.post_feedforward_norm(out), RESIDUAL), aux

    def __call__(self, x, positions, inv_freq, opts: RunOptions, segment_ids=None):
        out = self.attention(self.input_norm(x), positions, inv_freq, opts, segment_ids=segment_ids)
        return self._feed_forward(constrain(opts.rules, x + self.post_attention_norm(out), RESIDUAL), opts)

    def cached(self, x, positions, inv_freq, kv_cache, write_at, mask, opts: RunOptions):
        out, kv_cache = self.attention.cached(self.input_norm(x), positions, inv_freq, kv_cache, write_at, mask, opts)
        x, _ = self._feed_forward(constrain(opts.rules, x + self.post_attention_norm(out), RESIDUAL), opts)
        return x, kv_cache
