"""`llama_patterned`: a test-double family, Llama's decoder with the shared attention-pattern keys
(`jaxpar.models.attention_pattern.option_keys`) and `PatternedDecoder`, so the pattern can be proven
on every axis before a real family (gpt-oss, Gemma 3) opts in. Tests add it to the family table for
their duration with the `patterned_family` fixture pattern: monkeypatch.setitem(FAMILIES, NAME, FAMILY)."""

from jaxpar.models.attention_layers import PatternedDecoder
from jaxpar.models.attention_pattern import option_keys
from jaxpar.models.attention_pattern import ranges as pattern_ranges
from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.models.family import Family
from jaxpar.models.llama import costs, hf
from jaxpar.models.schema import decoder_config

NAME = "llama_patterned"


class PatternedLlama(PatternedDecoder):
    """Llama's decoder with the attention pattern."""


def schema(**overrides):
    return decoder_config(**{"model_type": NAME, **option_keys(), **overrides})


FAMILY = Family(
    name=NAME, module=PatternedLlama, schema=schema, ranges=lambda m: decoder_ranges(m) + pattern_ranges(m),
    checks=decoder_checks, hf=hf.ADAPTER, facts=costs.facts, aux_losses=None,
)
