"""Mixtral's `config.model` keys and defaults: the decoder keys (Mixtral 8x7B's values) plus
MixtralConfig's MoE keys and jaxpar's own MoE options (`jaxpar.models.moe.option_keys`)."""

from jaxpar.models import moe
from jaxpar.models.schema import decoder_config


def model_config(**overrides):
    """A Mixtral `config.model` section."""
    model = decoder_config(
        model_type="mixtral",
        intermediate_size=14336,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        max_position_embeddings=32768,
    )
    model.update(
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,  # Mixtral 8x7B's value (MixtralConfig's default is 0.001)
            **moe.option_keys(),
        )
    )
    model.update(overrides)
    return model


def moe_spec(model) -> moe.MoESpec:
    """Every layer routes to `num_local_experts` experts of `intermediate_size`, top-k renormalised."""
    return moe.spec_from(
        model, experts=model.num_local_experts, expert_ffn=model.intermediate_size, normalize_top_k=True
    )
