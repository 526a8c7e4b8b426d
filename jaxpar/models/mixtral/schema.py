"""Mixtral's `config.model` keys and defaults: the decoder keys (Mixtral 8x7B's values) plus
MixtralConfig's MoE keys, `capacity_factor` and `router_z_loss_coef` (see `jaxpar.models.moe`)."""

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
            router_z_loss_coef=0.0,
            # 0: dropless. > 0: each expert takes at most ceil(seq_len * k / E * factor) tokens
            # of each sequence; the rest are dropped (their MoE output is zero).
            capacity_factor=0.0,
        )
    )
    model.update(overrides)
    return model
