"""DeepSeek-V3's facts: per layer MLA (`attention_params`: the query path, the latent
down-projection and its norm, the per-head up-projection, the output), the block's two norms, and a
dense SwiGLU of `intermediate_size` (the first `first_k_dense_replace` layers) or the routed layer
(router [D, E], its selection bias [E], E experts of which each token runs k, the shared experts);
then `num_nextn_predict_layers` prediction modules (two norms, `eh_proj` [2D, D], a routed block and
the head's norm). A training step runs each module's block as one more routed layer and the LM
head once more: the facts count L + D blocks (their per-layer FLOPs are means over them, `eh_proj`
with the latent down-projections, replicated like them) and D + 1 heads, so the cost model prices MTP as what it runs.

The attention kernels run q, k and v at one head size, the larger of the query / key head
(`qk_nope_head_dim + qk_rope_head_dim`) and the value head (`jaxpar.models.deepseek_v3.attention`):
that is the facts' `head_dim`, and what the attention FLOPs per key count. The down-projections
into the latents run whole on every tensor rank (`flops_latent`), and tensor parallelism reduces
the attention's input gradients at the latents (`latent_widths`: q latent or x, kv latent, RoPE key)."""

from jaxpar.model_facts import ModelFacts, MoEFacts, padded_vocab_size
from jaxpar.models.costs import swiglu_params
from jaxpar.models.deepseek_v3.schema import dense_layers


def query_params(model) -> int:
    d, h, qk = model.hidden_size, model.num_attention_heads, model.qk_nope_head_dim + model.qk_rope_head_dim
    if model.q_lora_rank is None:
        return d * h * qk
    return d * model.q_lora_rank + model.q_lora_rank + model.q_lora_rank * h * qk  # q_a, its norm, q_b


def key_value_params(model) -> int:
    """kv_a [D, rank + rope], its norm [rank], kv_b [rank, H, nope + v]."""
    d, h, rank = model.hidden_size, model.num_attention_heads, model.kv_lora_rank
    return d * (rank + model.qk_rope_head_dim) + rank + rank * h * (model.qk_nope_head_dim + model.v_head_dim)


def attention_params(model) -> int:
    return query_params(model) + key_value_params(model) + model.num_attention_heads * model.v_head_dim * model.hidden_size


def facts(model) -> ModelFacts:
    d, h, layers, vocab = model.hidden_size, model.num_attention_heads, model.num_hidden_layers, padded_vocab_size(model.vocab_size)
    experts, k, f = model.n_routed_experts, model.num_experts_per_tok, model.moe_intermediate_size
    shared_ffn = model.n_shared_experts * f
    dense = len(dense_layers(model))
    routed = layers - dense
    base = attention_params(model) + 2 * d  # attention and the block's two norms
    router = d * experts + experts  # the router and its selection bias
    shared = swiglu_params(d, shared_ffn)
    expert = swiglu_params(d, f)
    dense_mlp = swiglu_params(d, model.intermediate_size)
    moe_layer = base + router + shared
    depth = model.num_nextn_predict_layers
    module = 2 * d + 2 * d * d + d  # enorm, hnorm, eh_proj, the head's norm
    total = routed * (moe_layer + experts * expert) + dense * (base + dense_mlp)
    total += depth * (module + moe_layer + experts * expert)
    active = routed * (moe_layer + k * expert) + dense * (base + dense_mlp) + depth * (module + moe_layer + k * expert)
    table = vocab * d
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    rank, rope, q_rank = model.kv_lora_rank, model.qk_rope_head_dim, model.q_lora_rank
    blocks = layers + depth  # what a training step runs
    down = d * (rank + rope) + (d * q_rank if q_rank is not None else 0)
    return ModelFacts(
        family=model.model_type,
        layers=blocks,
        hidden=d,
        heads=h,
        kv_heads=model.num_key_value_heads,
        head_dim=max(qk, model.v_head_dim),
        ffn=model.intermediate_size if dense else 0,
        vocab_size=model.vocab_size,
        vocab=vocab,
        tied_embeddings=bool(model.tie_word_embeddings),
        moe=MoEFacts(
            experts=experts, top_k=k, capacity_factor=float(model.capacity_factor), expert_ffn=f,
            layer_share=(routed + depth) / blocks, shared_ffn=shared_ffn,
        ),
        params_total=total + table + d + (0 if model.tie_word_embeddings else table),
        params_active=active + d + table,
        flops_q_o=2.0 * (query_params(model) - (q_rank or 0) - (d * q_rank if q_rank is not None else 0) + h * model.v_head_dim * d),
        flops_k_v=2.0 * (key_value_params(model) - rank - d * (rank + rope)),
        flops_attention_per_key=4.0 * h * max(qk, model.v_head_dim),
        flops_mlp=2.0 * (dense * dense_mlp + (routed + depth) * shared) / blocks,
        flops_expert_row=2.0 * expert,
        flops_router=2.0 * d * experts,
        flops_head=2.0 * d * vocab * (1 + depth),
        flops_latent=2.0 * (down + depth * 2 * d * d / blocks),  # eh_proj [2D, D] is replicated too
        latent_widths=(d if q_rank is None else q_rank, rank, rope),
        table_uses=1 + depth,
        kv_latent_width=rank + rope,
        staged_layers=routed,  # the dense layers run on the pipeline's first stage, the modules on its last
    )
