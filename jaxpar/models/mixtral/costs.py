"""Mixtral's facts: per layer a router [D, E] and E SwiGLU experts of `intermediate_size`, of
which each token runs `num_experts_per_tok` (k / E of the experts' parameters are active)."""

from jaxpar.model_facts import MoEFacts
from jaxpar.models.costs import attention_params, decoder_facts, norm_params, swiglu_params


def facts(model):
    d, f = model.hidden_size, model.intermediate_size
    experts, k = model.num_local_experts, model.num_experts_per_tok
    expert = swiglu_params(d, f)
    router = d * experts
    shared = attention_params(model) + norm_params(model) + router
    return decoder_facts(
        model,
        layer_params=shared + experts * expert,
        active_layer_params=shared + k * expert,
        flops_mlp=0.0,
        moe=MoEFacts(experts=experts, top_k=k, capacity_factor=float(model.capacity_factor), expert_ffn=f),
        flops_expert_row=2.0 * expert,
        flops_router=2.0 * router,
        ffn=0,
    )
