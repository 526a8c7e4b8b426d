"""gpt-oss's facts: per layer attention with biases (q, k, v [heads × head_dim], o [D]) and the
sinks [H], the two norms, a router [D, E] with its bias [E], and E experts of `intermediate_size`
with their biases (gate and up [F], down [D]), of which each token runs `num_experts_per_tok`."""

from jaxpar.model_facts import MoEFacts, head_dim_of
from jaxpar.models.costs import attention_params, decoder_facts, norm_params, swiglu_params


def facts(model):
    d, f = model.hidden_size, model.intermediate_size
    experts, k = model.num_local_experts, model.num_experts_per_tok
    h, kv = model.num_attention_heads, model.num_key_value_heads
    biases = (h + 2 * kv) * head_dim_of(model) + d if model.attention_bias else 0
    sinks = h if model.attention_sinks else 0
    expert = swiglu_params(d, f) + 2 * f + d
    router = d * experts + experts
    window = 1  # the layer's window, a leaf of the layer stack (`jaxpar.models.attention_layers.LayerWindow`)
    shared = attention_params(model) + biases + sinks + window + norm_params(model) + router
    return decoder_facts(
        model,
        layer_params=shared + experts * expert,
        active_layer_params=shared + k * expert,
        flops_mlp=0.0,
        moe=MoEFacts(experts=experts, top_k=k, capacity_factor=float(model.capacity_factor), expert_ffn=f),
        flops_expert_row=2.0 * swiglu_params(d, f),
        flops_router=2.0 * d * experts,
        ffn=0,
    )
