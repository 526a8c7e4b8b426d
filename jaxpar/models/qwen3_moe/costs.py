"""Qwen3-MoE's facts (Qwen2-MoE's too, with its shared expert and biases): per MoE layer attention,
norms (and QK-norm), a router [D, E] (and the loss-free bias [E]), E experts of
`moe_intermediate_size` of which each token runs k, and the shared expert with its [D, 1] gate;
per dense layer a SwiGLU MLP of `intermediate_size`. With dense layers among the MoE layers the
per-layer MLP FLOPs are means over the layers (`jaxpar.models.costs.decoder_facts`)."""

from jaxpar.model_facts import MoEFacts
from jaxpar.models.costs import attention_params, decoder_facts, norm_params, qk_norm_params, swiglu_params
from jaxpar.models.qwen3_moe.schema import dense_layers


def moe_decoder_facts(model, *, attention: int, shared_ffn: int = 0, qk_norm: bool = False):
    """Facts of a Qwen MoE stack whose layers' attention (with its norms, biases) holds `attention`
    parameters; `shared_ffn`: the shared expert's hidden size (0: none)."""
    d, layers = model.hidden_size, model.num_hidden_layers
    experts, k, f = model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size
    dense = len(dense_layers(model))
    routed = layers - dense
    expert = swiglu_params(d, f)
    router = d * experts + (experts if model.router_bias_update_rate > 0 else 0)
    shared = swiglu_params(d, shared_ffn) + d if shared_ffn else 0  # the shared expert and its gate
    base = attention + norm_params(model)
    dense_mlp = swiglu_params(d, model.intermediate_size)
    moe_layer = base + router + shared
    total = routed * (moe_layer + experts * expert) + dense * (base + dense_mlp)
    active = routed * (moe_layer + k * expert) + dense * (base + dense_mlp)
    return decoder_facts(
        model,
        layer_params=0,
        active_layer_params=0,
        stack_params=(total, active),
        flops_mlp=2.0 * (dense * dense_mlp + routed * shared) / layers,
        moe=MoEFacts(
            experts=experts, top_k=k, capacity_factor=float(model.capacity_factor), expert_ffn=f,
            layer_share=routed / layers, shared_ffn=shared_ffn,
        ),
        flops_expert_row=2.0 * expert,
        flops_router=2.0 * d * experts,
        ffn=model.intermediate_size if dense else 0,
        qk_norm=qk_norm,
    )


def facts(model):
    return moe_decoder_facts(model, attention=attention_params(model) + qk_norm_params(model), qk_norm=True)
