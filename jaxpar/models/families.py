"""The model families: one table of their records (`jaxpar.models.family.Family`).

Adding a family is a folder `jaxpar/models/<family>/` with its `FAMILY` record, and one entry in
`FAMILIES` below. Nothing registers itself: this module imports the families, so imports flow one
way. Everything else asks `family(model_type)` for the record, or `facts(config.model)` for the
numbers (`jaxpar.model_facts.ModelFacts`), and never compares a `model_type` to a name.
"""

from __future__ import annotations

from jaxpar.model_facts import ModelFacts
from jaxpar.models import deepseek_v3, gemma3_text, gpt_oss, llama, mixtral, qwen2_moe, qwen3, qwen3_moe
from jaxpar.models.family import Family

FAMILIES = {
    record.name: record
    for record in (llama.FAMILY, mixtral.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, qwen2_moe.FAMILY, deepseek_v3.FAMILY,
                   gpt_oss.FAMILY, gemma3_text.FAMILY)
}


class UnknownFamily(ValueError):
    pass


def family(model_type) -> Family:
    if model_type not in FAMILIES:
        raise UnknownFamily(f"model.model_type={model_type!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def facts(model_config) -> ModelFacts:
    """The family's facts of this `config.model` (sizes, parameter counts, FLOPs per layer)."""
    return family(model_config.model_type).facts(model_config)
