"""Qwen3's attention: the decoder's grouped-query attention with QK-norm, an RMSNorm over each
head's q and k (one [head_dim] scale each, shared by the heads) after the projections and before
RoPE, as transformers' Qwen3Attention. Qwen3-MoE uses it too."""

from __future__ import annotations

from flax import nnx

from jaxpar.model_facts import head_dim_of
from jaxpar.models.layers import Attention, RMSNorm
from jaxpar.models.options import RunOptions


class QKNormAttention(Attention):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.q_norm = RMSNorm(head_dim_of(cfg), cfg.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim_of(cfg), cfg.rms_norm_eps)

    def project_qkv(self, x, opts: RunOptions):
        q, k, v = super().project_qkv(x, opts)
        return self.q_norm(q), self.k_norm(k), v
