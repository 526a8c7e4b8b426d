"""gpt-oss (transformers' GptOssForCausalLM): OpenAI's open-weight MoE models, gpt-oss-20b and -120b.

Attention (`attention`): grouped-query with biases, learned per-head sinks, YaRN RoPE, and a
128-token sliding window on every other layer (`layer_types`), as the shared attention pattern
(`jaxpar.models.attention_layers.PatternedDecoder`) runs it on every path. Every layer's MLP is
`jaxpar.models.moe`'s sparse block with gpt-oss's router bias, expert biases and clamped SwiGLU
(`schema.moe_spec`). Checkpoints (`hf`): bf16 / fp32 tensors, or the released MXFP4 experts
dequantized on load (`mxfp4`).

The folder: `schema`, `attention`, `checks`, `costs`, `hf`, `mxfp4`; `FAMILY` is the record.
"""

from jaxpar.models import moe
from jaxpar.models.attention_layers import PatternedDecoder
from jaxpar.models.family import Family
from jaxpar.models.gpt_oss import attention, checks, costs, hf
from jaxpar.models.gpt_oss.schema import model_config, moe_spec


class GptOss(PatternedDecoder):
    make_attention = attention.GptOssAttention
    make_mlp = moe.moe_block(moe_spec)
    rope_frequencies = staticmethod(attention.inverse_frequencies)


FAMILY = Family(
    name="gpt_oss",
    module=GptOss,
    schema=model_config,
    ranges=checks.ranges,
    checks=checks.checks,
    hf=hf.ADAPTER,
    facts=costs.facts,
    aux_losses=moe.aux_losses_for(moe_spec),
)

__all__ = ["FAMILY", "GptOss", "model_config"]
