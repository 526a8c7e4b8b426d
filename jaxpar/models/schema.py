"""The `config.model` keys every decoder family shares, with Llama's defaults.

A family's schema (`jaxpar.models.<family>.model_config`) starts from `decoder_config` and adds its
own keys; preflight rejects any key not in the schema of the config's `model.model_type`. Keys are
named as in the family's transformers config (LlamaConfig's here).
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

# `model.rope_scaling.rope_type` values (transformers' names).
ROPE_TYPES = ("default", "llama3")


def decoder_config(**overrides) -> ConfigDict:
    """A decoder `config.model` section: LlamaConfig's field names and defaults plus `model_type`."""
    model = ConfigDict(
        dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            # None: hidden_size // num_attention_heads.
            head_dim=placeholder(int),
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            # rope_type "default" or "llama3"; the other fields are used by llama3 only.
            rope_scaling=dict(
                rope_type="default",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            initializer_range=0.02,
        )
    )
    model.update(overrides)
    return model
