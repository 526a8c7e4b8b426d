"""gpt-oss's attention and RoPE: the patterned attention (`jaxpar.models.attention_layers`: the
layer's window, learned sinks) with biases on q, k, v and o (`attention_bias`), rotated by YaRN
(`jaxpar.models.rope`). YaRN's attention factor m multiplies cos and sin in transformers, so q and
k alike: every score is multiplied by m², folded here into the softmax scale."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxpar.model_facts import head_dim_of
from jaxpar.models.attention_layers import PatternedAttention
from jaxpar.models.layers import rope_inverse_frequencies
from jaxpar.models.options import RunOptions
from jaxpar.models.rope import yarn_inverse_frequencies, yarn_mscale


def is_yarn(cfg) -> bool:
    return cfg.rope_scaling.rope_type == "yarn"


def inverse_frequencies(cfg) -> jnp.ndarray:
    """Per-pair rotation frequencies [head_dim / 2]: YaRN's, or plain RoPE's."""
    if not is_yarn(cfg):
        return rope_inverse_frequencies(cfg)
    s = cfg.rope_scaling
    return yarn_inverse_frequencies(head_dim_of(cfg), cfg.rope_theta, s.factor, s.original_max_position_embeddings,
                                    s.beta_fast, s.beta_slow, truncate=bool(s.truncate))


def score_scale(cfg) -> float:
    """1 / sqrt(head_dim), times YaRN's attention factor squared."""
    mscale = yarn_mscale(cfg.rope_scaling.factor) if is_yarn(cfg) else 1.0
    return head_dim_of(cfg) ** -0.5 * mscale**2


class GptOssAttention(PatternedAttention):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.scale = score_scale(cfg)
        self.has_bias = bool(cfg.attention_bias)
        if self.has_bias:
            h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
            self.q_bias = nnx.Param(jnp.zeros((h, hd), jnp.float32), out_sharding=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((kv, hd), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((kv, hd), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.o_bias = nnx.Param(jnp.zeros((cfg.hidden_size,), jnp.float32), out_sharding=("norm",))

    def project_qkv(self, x, opts: RunOptions):
        q, k, v = super().project_qkv(x, opts)
        if not self.has_bias:
            return q, k, v
        bias = lambda p: p[...].astype(q.dtype)  # noqa: E731
        return q + bias(self.q_bias), k + bias(self.k_bias), v + bias(self.v_bias)

    def _output(self, out, opts: RunOptions):
        out = super()._output(out, opts)
        return out + self.o_bias[...].astype(out.dtype) if self.has_bias else out
