"""Qwen3 (transformers' Qwen3ForCausalLM): Llama's decoder with QK-norm (`attention.QKNormAttention`,
the family's attention hook), `head_dim` independent of hidden_size / heads, tied or untied
embeddings.

The folder: `schema` (`config.model` keys and defaults), the checks (the decoder's), `hf` (the
transformers adapter), `costs` (parameter counts and FLOPs per layer); `FAMILY` is its record.
"""

from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.models.decoder import Decoder
from jaxpar.models.family import Family
from jaxpar.models.qwen3 import costs, hf
from jaxpar.models.qwen3.attention import QKNormAttention
from jaxpar.models.qwen3.schema import model_config


class Qwen3(Decoder):
    make_attention = QKNormAttention


FAMILY = Family(
    name="qwen3",
    module=Qwen3,
    schema=model_config,
    ranges=decoder_ranges,
    checks=decoder_checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=None,
)

__all__ = ["FAMILY", "Qwen3", "QKNormAttention", "model_config"]
