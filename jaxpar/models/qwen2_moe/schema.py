"""Qwen2-MoE's `config.model` keys and defaults: Qwen2MoeConfig's names and defaults (Qwen1.5-MoE-
A2.7B-shaped) over the shared decoder keys, plus jaxpar's own MoE options. Which layers are MoE:
Qwen3-MoE's rule (`jaxpar.models.qwen3_moe.schema.dense_layers`)."""

from jaxpar.models import moe
from jaxpar.models.schema import decoder_config


def model_config(**overrides):
    """A Qwen2-MoE `config.model` section."""
    model = decoder_config(
        model_type="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,  # the dense layers' MLP (if any)
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )
    model.update(
        dict(
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            qkv_bias=True,
            **moe.option_keys(),
        )
    )
    model.update(overrides)
    return model


def moe_spec(model) -> moe.MoESpec:
    return moe.spec_from(
        model, experts=model.num_experts, expert_ffn=model.moe_intermediate_size, normalize_top_k=model.norm_topk_prob,
        shared_ffn=model.shared_expert_intermediate_size,
    )
