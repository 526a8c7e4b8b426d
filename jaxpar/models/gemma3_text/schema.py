"""Gemma 3's `config.model` keys and defaults: Gemma3TextConfig's names and defaults over the shared
decoder keys and the attention pattern's (`jaxpar.models.attention_pattern.option_keys`), plus
`sliding_window_pattern` (every sixth layer full: five local layers per global one, as
transformers derives `layer_types` when a config has none), `rope_local_base_freq` (the sliding
layers' RoPE base; `rope_theta` and `rope_scaling` are the full layers') and
`final_logit_softcapping`."""

from ml_collections.config_dict import placeholder

from jaxpar.models.attention_pattern import option_keys
from jaxpar.models.schema import decoder_config

ROPE_TYPES = ("default", "linear")  # the full layers' scaling in the released checkpoints (27B: linear, 8)


def model_config(**overrides):
    """A Gemma 3 text `config.model` section, Gemma3TextConfig field names plus `model_type`."""
    return decoder_config(
        **{
            "model_type": "gemma3_text",
            "vocab_size": 262208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            **option_keys(),
            "sliding_window": 4096,
            "query_pre_attn_scalar": 256.0,
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10_000.0,
            "final_logit_softcapping": placeholder(float),
            **overrides,
        }
    )
