"""Gemma 3's text model (transformers' Gemma3ForCausalLM, `model_type` gemma3_text): the patterned
decoder (`jaxpar.models.attention_layers.PatternedDecoder`) with five sliding-window layers per
full one (`sliding_window_pattern`, or `layer_types`), each kind with its own RoPE base (one row
of `rope_frequencies` per kind, picked per layer by its window: `PatternedAttention.
layer_frequencies`), QK-norm, four norms per block scaling by 1 + weight, a GeGLU MLP with tanh
GELU, scores scaled by `query_pre_attn_scalar`^-1/2, the LM head's optional soft-cap (the
attention's is refused: transformers' Gemma 3 keeps the key but never applies it), the embedding
multiplied by √hidden_size (rounded to fp32, then to the compute dtype, as transformers does), tied
embeddings.

The folder: `schema` (keys and defaults), `layers` (the norm, attention, MLP and block), `hf` (the
transformers adapter), `costs` (parameter counts and FLOPs); `FAMILY` is its record.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxpar.model_facts import head_dim_of
from jaxpar.models.attention_layers import PatternedDecoder
from jaxpar.models.attention_pattern import ranges as pattern_ranges
from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.models.family import Family
from jaxpar.models.gemma3_text import costs, hf
from jaxpar.models.gemma3_text.layers import GeGLU, Gemma3Attention, Gemma3Block, GemmaRMSNorm
from jaxpar.models.gemma3_text.schema import ROPE_TYPES, model_config
from jaxpar.models.layers import rope_inverse_frequencies
from jaxpar.ranges import at_least, one_of, positive


def rope_frequencies(cfg):
    """[2, head_dim / 2]: the full layers' frequencies (rope_theta, rope_scaling), then the sliding
    layers' (rope_local_base_freq, unscaled)."""
    dim = head_dim_of(cfg)
    local = 1.0 / (cfg.rope_local_base_freq ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    return jnp.stack([rope_inverse_frequencies(cfg), local])


class Gemma3Text(PatternedDecoder):
    make_attention = Gemma3Attention
    make_mlp = GeGLU
    make_block = Gemma3Block
    rope_frequencies = staticmethod(rope_frequencies)

    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.final_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def embedding_scale(cfg) -> float:
        return math.sqrt(cfg.hidden_size)

    @staticmethod
    def final_logit_softcap(cfg) -> float | None:
        return cfg.final_logit_softcapping


def ranges(model) -> list[str]:
    errors = decoder_ranges(model) + pattern_ranges(model)
    errors += one_of("model.rope_scaling.rope_type", model.rope_scaling.rope_type, ROPE_TYPES)
    errors += positive("model.rope_local_base_freq", model.rope_local_base_freq)
    errors += at_least("model.sliding_window_pattern", model.sliding_window_pattern, 1)
    if model.final_logit_softcapping is not None:
        errors += positive("model.final_logit_softcapping", model.final_logit_softcapping)
    if model.attn_logit_softcapping is not None:
        errors.append(f"model.attn_logit_softcapping={model.attn_logit_softcapping}: transformers' Gemma 3 does not apply it "
                      "(Gemma 2 does); leave it None")
    if model.attention_sinks:
        errors.append("model.attention_sinks=True: Gemma 3 has no attention sinks (transformers' model cannot hold them)")
    return errors


FAMILY = Family(
    name="gemma3_text", module=Gemma3Text, schema=model_config, ranges=ranges, checks=decoder_checks, hf=hf.ADAPTER,
    facts=costs.facts, aux_losses=None,
)

__all__ = ["FAMILY", "Gemma3Text", "model_config"]
