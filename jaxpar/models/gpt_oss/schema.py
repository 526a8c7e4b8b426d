"""gpt-oss's `config.model` keys and defaults: GptOssConfig's names and defaults (gpt-oss-120b's
shapes) over the shared decoder keys, the attention pattern's keys
(`jaxpar.models.attention_pattern.option_keys`: a 128-token window on every other layer, sinks
always) and jaxpar's own MoE options.

The experts are gated MLPs with biases whose activation is gpt-oss's clamped SwiGLU
(`ClampedSwiGLU`); the router has a bias, takes the top k logits and softmaxes over them (the same
weights as renormalising the top k of the softmax: `normalize_top_k`). RoPE is YaRN with the ramp
not truncated (`rope_scaling.truncate` False), or plain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxpar.models import moe
from jaxpar.models.attention_pattern import FULL, SLIDING, option_keys
from jaxpar.models.schema import decoder_config

ROPE_TYPES = ("default", "yarn")


def alternating(layers: int) -> list[str]:
    """gpt-oss's pattern (GptOssConfig's default): even layers sliding, odd ones full."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]


def model_config(**overrides):
    """A gpt-oss `config.model` section; `layer_types` follows `num_hidden_layers` unless given."""
    model = decoder_config(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,  # each expert's hidden size
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        max_position_embeddings=131072,
    )
    model.rope_scaling = ConfigDict(
        dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096)
    )
    model.update(option_keys())
    model.update(
        dict(
            sliding_window=128,
            attention_sinks=True,
            attention_bias=True,
            num_local_experts=128,
            num_experts_per_tok=4,
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
            router_aux_loss_coef=0.001,
            **moe.option_keys(),
        )
    )
    rope = overrides.pop("rope_scaling", None)
    if rope is not None:
        model.rope_scaling.update(rope)
    model.update(overrides)
    if "layer_types" not in overrides:
        model.layer_types = alternating(model.num_hidden_layers)
    return model


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' `GptOssExperts._apply_gate`): the gate clamped
    above at `limit`, the up projection to ±`limit`, (up + 1) · gate · sigmoid(alpha · gate).
    A value, not a closure: the spec it sits in is part of the module's static structure."""

    alpha: float
    limit: float

    def __call__(self, gate, up):
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def moe_spec(model) -> moe.MoESpec:
    """Every layer routes: softmax over the top k biased logits, experts with biases and the clamped SwiGLU."""
    spec = moe.spec_from(model, experts=model.num_local_experts, expert_ffn=model.intermediate_size, normalize_top_k=True)
    activation = ClampedSwiGLU(float(model.swiglu_alpha), float(model.swiglu_limit))
    return dataclasses.replace(spec, logit_bias=True, expert_bias=True, activation=activation)
