"""Llama's facts: attention, two norms and a SwiGLU MLP per layer, every parameter active."""

from jaxpar.models.costs import attention_params, decoder_facts, norm_params, swiglu_params


def facts(model):
    mlp = swiglu_params(model.hidden_size, model.intermediate_size)
    layer = attention_params(model) + norm_params(model) + mlp
    return decoder_facts(model, layer_params=layer, active_layer_params=layer, flops_mlp=2.0 * mlp)
