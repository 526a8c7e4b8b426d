"""Qwen2-MoE's attention: the decoder's grouped-query attention with biases on q, k and v (not o),
as transformers' Qwen2MoeAttention with `qkv_bias` (every released checkpoint has them)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxpar.model_facts import head_dim_of
from jaxpar.models.layers import Attention
from jaxpar.models.options import RunOptions


class QKVBiasAttention(Attention):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.has_bias = bool(cfg.qkv_bias)
        if self.has_bias:
            h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
            self.q_bias = nnx.Param(jnp.zeros((h, hd), jnp.float32), out_sharding=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((kv, hd), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((kv, hd), jnp.float32), out_sharding=("kv_heads", "head_dim"))

    def project_qkv(self, x, opts: RunOptions):
        q, k, v = super().project_qkv(x, opts)
        if not self.has_bias:
            return q, k, v
        bias = lambda p: p[...].astype(q.dtype)  # noqa: E731
        return q + bias(self.q_bias), k + bias(self.k_bias), v + bias(self.v_bias)
