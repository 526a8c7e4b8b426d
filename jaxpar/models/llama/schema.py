"""Llama's `config.model` keys and defaults: LlamaConfig's names (`jaxpar.models.schema`)."""

from jaxpar.models.schema import decoder_config


def model_config(**overrides):
    """A Llama `config.model` section, LlamaConfig field names plus `model_type`."""
    return decoder_config(**{"model_type": "llama", **overrides})
