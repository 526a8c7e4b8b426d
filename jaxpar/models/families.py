"""The model families as records, and the one table that holds them.

A family record names everything that differs between Llama and Mixtral: the NNX module, the
`config.model` schema with its defaults, the config checks, the transformers adapter, and the
auxiliary losses (None for a dense model). Nothing registers itself: this module imports the
families, so imports flow one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jaxpar.config import llama_model_config, mixtral_model_config
from jaxpar.interop import hf_llama, hf_mixtral
from jaxpar.interop.hf_core import Adapter
from jaxpar.models import checks, moe
from jaxpar.models.llama import Llama
from jaxpar.models.mixtral import Mixtral


@dataclass(frozen=True)
class Family:
    name: str  # `model.model_type`
    module: type  # the flax.nnx module class, built as module(cfg, rngs=...)
    schema: Callable  # () -> the `config.model` ConfigDict with every key and its default
    checks: Callable  # (config.model, mesh sizes) -> one line per problem
    hf: Adapter  # transformers checkpoints: config.json and tensor layouts
    aux_losses: Callable | None  # (cfg, per-layer aux) -> (extra loss, metrics); None: dense model


LLAMA = Family("llama", Llama, llama_model_config, checks.llama, hf_llama.ADAPTER, aux_losses=None)
MIXTRAL = Family("mixtral", Mixtral, mixtral_model_config, checks.mixtral, hf_mixtral.ADAPTER, aux_losses=moe.aux_losses)

FAMILIES = {family.name: family for family in (LLAMA, MIXTRAL)}


class UnknownFamily(ValueError):
    pass


def family(model_type) -> Family:
    if model_type not in FAMILIES:
        raise UnknownFamily(f"model.model_type={model_type!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]
