"""Llama (transformers' LlamaForCausalLM): grouped-query attention with RoPE (default or llama3
scaling), RMSNorm, a SwiGLU MLP, tied or untied embeddings.

The family is this folder: `schema` (`config.model` keys and defaults), the checks (the decoder's,
`jaxpar.models.checks`), `hf` (the transformers adapter), `costs` (parameter counts and FLOPs per
layer). `FAMILY` is its record (`jaxpar.models.family`).
"""

from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.models.decoder import Decoder
from jaxpar.models.family import Family
from jaxpar.models.llama import costs, hf
from jaxpar.models.llama.schema import model_config


class Llama(Decoder):
    """The decoder with its default hooks: `Attention` and the SwiGLU `MLP`."""


FAMILY = Family(
    name="llama",
    module=Llama,
    schema=model_config,
    ranges=decoder_ranges,
    checks=decoder_checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=None,
)

__all__ = ["FAMILY", "Llama", "model_config"]
