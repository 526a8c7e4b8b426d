"""Mixtral: Llama's attention, norms, embeddings and layer scan, with a sparse MoE block as MLP.

`Mixtral.__call__` (inherited) returns (logits, aux) with aux the per-layer router statistics
stacked over layers; the family record (`jaxpar.models.families`) names `moe.aux_losses` as
what turns them into the loss terms and metrics the train step adds.
"""

from __future__ import annotations

from jaxpar.models.llama import Llama
from jaxpar.models.moe import MoEBlock


class Mixtral(Llama):
    make_mlp = MoEBlock
