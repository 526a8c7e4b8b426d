"""Qwen2-MoE's facts: Qwen3-MoE's (`jaxpar.models.qwen3_moe.costs`) with q/k/v biases instead of
QK-norm and a shared expert of `shared_expert_intermediate_size` with its sigmoid gate in every
MoE layer (all of it active for every token)."""

from jaxpar.model_facts import head_dim_of
from jaxpar.models.costs import attention_params
from jaxpar.models.qwen3_moe.costs import moe_decoder_facts


def facts(model):
    biases = (model.num_attention_heads + 2 * model.num_key_value_heads) * head_dim_of(model) if model.qkv_bias else 0
    return moe_decoder_facts(
        model, attention=attention_params(model) + biases, shared_ffn=model.shared_expert_intermediate_size
    )
