"""Qwen2-MoE (transformers' Qwen2MoeForCausalLM): a shared expert beside the routed ones in every
MoE layer, scaled per token by sigmoid(x @ shared_expert_gate) (`jaxpar.models.moe`'s shared
expert), q/k/v biases (`attention.QKVBiasAttention`), Qwen3-MoE's layer pattern and aux loss.

The folder: `schema`, `checks`, `hf`, `costs`; `FAMILY` is the record.
"""

from jaxpar.models import moe
from jaxpar.models.decoder import Decoder
from jaxpar.models.family import Family
from jaxpar.models.qwen2_moe import checks, costs, hf
from jaxpar.models.qwen2_moe.attention import QKVBiasAttention
from jaxpar.models.qwen2_moe.schema import model_config, moe_spec
from jaxpar.models.qwen3_moe.schema import dense_layers


class Qwen2Moe(Decoder):
    make_attention = QKVBiasAttention
    make_mlp = moe.moe_block(moe_spec)
    dense_layer_indices = staticmethod(dense_layers)


FAMILY = Family(
    name="qwen2_moe",
    module=Qwen2Moe,
    schema=model_config,
    ranges=checks.ranges,
    checks=checks.checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=moe.aux_losses_for(moe_spec),
)

__all__ = ["FAMILY", "Qwen2Moe", "model_config"]
