"""Qwen3's `config.model` keys and defaults: Qwen3Config's names and defaults (`head_dim` 128,
independent of hidden_size / heads) over the shared decoder keys (`jaxpar.models.schema`)."""

from jaxpar.models.schema import decoder_config

QWEN3_HEAD_DIM = 128  # Qwen3Config's default when config.json has none


def model_config(**overrides):
    """A Qwen3 `config.model` section, Qwen3Config field names plus `model_type`."""
    return decoder_config(
        **{
            "model_type": "qwen3",
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": QWEN3_HEAD_DIM,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            **overrides,
        }
    )
