"""Qwen3's facts: Llama's (attention, two norms, a SwiGLU MLP per layer) plus QK-norm's two
[head_dim] scales per layer, which add parameters but no matmul FLOPs."""

from jaxpar.models.costs import attention_params, decoder_facts, norm_params, qk_norm_params, swiglu_params


def facts(model):
    mlp = swiglu_params(model.hidden_size, model.intermediate_size)
    layer = attention_params(model) + norm_params(model) + qk_norm_params(model) + mlp
    return decoder_facts(model, layer_params=layer, active_layer_params=layer, flops_mlp=2.0 * mlp, qk_norm=True)
