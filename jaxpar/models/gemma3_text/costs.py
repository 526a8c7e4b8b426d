"""Gemma 3's facts: attention with QK-norm (two [head_dim] scales), four norms and a GeGLU MLP (the
SwiGLU's three matrices) per layer, and its window (one number of model state the params tree holds).
Attention FLOPs are counted over every key, as for full layers."""

from jaxpar.models.costs import attention_params, decoder_facts, norm_params, qk_norm_params, swiglu_params


def facts(model):
    mlp = swiglu_params(model.hidden_size, model.intermediate_size)
    layer = attention_params(model) + 2 * norm_params(model) + qk_norm_params(model) + mlp + 1
    return decoder_facts(model, layer_params=layer, active_layer_params=layer, flops_mlp=2.0 * mlp, qk_norm=True)
