"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): Qwen3's attention (QK-norm) with many
fine-grained experts (128, top-8 in Qwen3-30B-A3B), `norm_topk_prob`, and optionally dense layers
among the MoE layers (`mlp_only_layers`, `decoder_sparse_step`: the decoder's second layer stack).
The MoE layer is `jaxpar.models.moe`'s, described by `schema.moe_spec`; its auxiliary loss is
transformers' `load_balancing_loss_func`.

The folder: `schema`, `checks`, `hf`, `costs`; `FAMILY` is the record.
"""

from jaxpar.models import moe
from jaxpar.models.decoder import Decoder
from jaxpar.models.family import Family
from jaxpar.models.qwen3 import QKNormAttention
from jaxpar.models.qwen3_moe import checks, costs, hf
from jaxpar.models.qwen3_moe.schema import dense_layers, model_config, moe_spec


class Qwen3Moe(Decoder):
    make_attention = QKNormAttention
    make_mlp = moe.moe_block(moe_spec)
    dense_layer_indices = staticmethod(dense_layers)


FAMILY = Family(
    name="qwen3_moe",
    module=Qwen3Moe,
    schema=model_config,
    ranges=checks.ranges,
    checks=checks.checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=moe.aux_losses_for(moe_spec),
)

__all__ = ["FAMILY", "Qwen3Moe", "model_config"]
