"""Mixtral (transformers' MixtralForCausalLM): Llama's attention, norms, embeddings and layer scan,
with a sparse mixture-of-experts block (`jaxpar.models.moe`) as each layer's MLP hook.

`Mixtral.__call__` (the decoder's) returns (logits, aux) with aux the per-layer router statistics
stacked over layers; the record names `moe.aux_losses` as what turns them into the load-balancing
and z losses the train step adds. The folder: `schema`, `checks`, `hf`, `costs`; `FAMILY` is the record.
"""

from jaxpar.models import moe
from jaxpar.models.decoder import Decoder
from jaxpar.models.family import Family
from jaxpar.models.mixtral import checks, costs, hf
from jaxpar.models.mixtral.schema import model_config


class Mixtral(Decoder):
    make_mlp = moe.MoEBlock


FAMILY = Family(
    name="mixtral",
    module=Mixtral,
    schema=model_config,
    ranges=checks.ranges,
    checks=checks.checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=moe.aux_losses,
)

__all__ = ["FAMILY", "Mixtral", "model_config"]
