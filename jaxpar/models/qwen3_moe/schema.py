"""Qwen3-MoE's `config.model` keys and defaults: Qwen3MoeConfig's names and defaults over the shared
decoder keys, plus jaxpar's own MoE options (`jaxpar.models.moe.option_keys`).

Which layers are MoE follows transformers: layer i routes unless i is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; the others run a dense SwiGLU MLP of
`intermediate_size` (`dense_layers`). Qwen2-MoE shares the rule.
"""

from jaxpar.models import moe
from jaxpar.models.schema import decoder_config


def model_config(**overrides):
    """A Qwen3-MoE `config.model` section (Qwen3MoeConfig's defaults: Qwen3-15B-A2B-shaped)."""
    model = decoder_config(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,  # the dense layers' MLP (if any)
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )
    model.update(
        dict(
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            **moe.option_keys(),
        )
    )
    model.update(overrides)
    return model


def dense_layers(model) -> tuple[int, ...]:
    """The layers with a dense MLP (transformers' rule, see the module docstring)."""
    only = set(model.mlp_only_layers)
    step = max(model.decoder_sparse_step, 1)
    return tuple(i for i in range(model.num_hidden_layers) if i in only or (i + 1) % step)


def moe_spec(model) -> moe.MoESpec:
    return moe.spec_from(
        model, experts=model.num_experts, expert_ffn=model.moe_intermediate_size, normalize_top_k=model.norm_topk_prob
    )
