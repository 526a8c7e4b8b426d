"""The family record: everything that differs between model families, named in one place.

A family is one folder, `jaxpar/models/<family>/`, whose `FAMILY` is a `Family`: the NNX module
(a `jaxpar.models.decoder.Decoder` with the family's attention and MLP hooks), the `config.model`
schema with its defaults, the config checks, the transformers adapter, the facts (sizes,
parameter counts, FLOPs per layer: `jaxpar.model_facts.ModelFacts`), and the auxiliary losses
(None for a dense model). `jaxpar.models.families` lists the families; nothing registers itself,
and no code outside a family's folder asks for a family by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxpar.models.hf_adapter import Adapter


@dataclass(frozen=True)
class Family:
    name: str  # `model.model_type`, as transformers spells it
    module: type  # the flax.nnx module class, built as module(cfg, rngs=...)
    schema: Callable  # (**overrides) -> the `config.model` ConfigDict with every key and its default
    ranges: Callable  # config.model -> one line per size or range problem (empty: the sizes are usable)
    checks: Callable  # (config.model, mesh sizes) -> one line per problem (run once the ranges pass)
    hf: Adapter  # transformers checkpoints: config.json and tensor layouts
    facts: Callable  # config.model -> jaxpar.model_facts.ModelFacts
    aux_losses: Callable | None  # (cfg, per-layer aux) -> (extra loss, metrics); None: dense model
