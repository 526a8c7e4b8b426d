"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Kimi K2, Moonlight and others ship it too).

Multi-head latent attention (`attention.LatentAttention`) with a decoupled RoPE key, YaRN and
interleaved pairs (`rope`); `first_k_dense_replace` dense layers, then MoE layers of
`jaxpar.models.moe` with sigmoid scores, the selection bias `e_score_correction_bias` (loss-free
balancing's `RouterBias`, moved when `router_bias_update_rate` > 0), group-limited top-k,
renormalised and scaled weights and ungated shared experts (`schema.moe_spec`); and
`num_nextn_predict_layers` multi-token prediction modules after the last layer (`mtp`).

The folder: `schema`, `checks`, `rope`, `attention`, `mtp`, `hf`, `costs`; `FAMILY` is the record.
"""

from jaxpar.models import moe
from jaxpar.models.decoder import Decoder
from jaxpar.models.deepseek_v3 import checks, costs, hf, mtp, rope
from jaxpar.models.deepseek_v3.attention import LatentAttention
from jaxpar.models.deepseek_v3.schema import dense_layers, model_config, moe_spec
from jaxpar.models.family import Family


class DeepseekV3(Decoder):
    make_attention = LatentAttention
    make_mlp = moe.moe_block(moe_spec)
    dense_layer_indices = staticmethod(dense_layers)
    dense_layers_axis = "depth"  # they lead: the pipeline's first stage runs them, unstaged
    rope_frequencies = staticmethod(rope.inverse_frequencies)

    @staticmethod
    def prediction_depth(cfg) -> int:
        return cfg.num_nextn_predict_layers

    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        depth = cfg.num_nextn_predict_layers
        self.mtp = mtp.prediction_modules(cfg, rngs, LatentAttention, type(self).make_mlp) if depth else None

    def predict_ahead(self, x, ahead, positions, opts, segment_ids, aux):
        inv_freq = rope.inverse_frequencies(self.cfg)
        return mtp.predict_ahead(self, x, ahead, positions, inv_freq, opts, segment_ids, aux)


FAMILY = Family(
    name="deepseek_v3",
    module=DeepseekV3,
    schema=model_config,
    ranges=checks.ranges,
    checks=checks.checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=moe.aux_losses_for(moe_spec),
)

__all__ = ["FAMILY", "DeepseekV3", "model_config"]
