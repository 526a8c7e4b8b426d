"""The `config.model` keys every decoder family shares, with Llama's defaults.

A family's schema (`jaxpar.models.<family>.model_config`) starts from `decoder_config` and adds its
own keys; preflight rejects any key not in the schema of the config's `model.model_type`. Keys are
named as in the family's transformers config (LlamaConfig's here).
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from jaxpar.models.attention_pattern import MEANINGS as PATTERN_MEANINGS

# `model.rope_scaling.rope_type` values (transformers' names).
ROPE_TYPES = ("default", "linear", "llama3")


def decoder_config(**overrides) -> ConfigDict:
    """A decoder `config.model` section: LlamaConfig's field names and defaults plus `model_type`."""
    model = ConfigDict(
        dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            # None: hidden_size // num_attention_heads.
            head_dim=placeholder(int),
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            # rope_type "default", "linear" or "llama3"; the other fields are read by the type they name.
            rope_scaling=dict(
                rope_type="default",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            initializer_range=0.02,
        )
    )
    model.update(overrides)
    return model


# What every `config.model` key of any family means, one line each (docs/config.md is generated from
# this table and the families' schemas; a family that adds a key adds its meaning here). The names
# are the transformers configs' except jaxpar's own MoE options (`jaxpar.models.moe.option_keys`).
MEANINGS = {
    "model_type": "the family, as transformers names it",
    "vocab_size": "tokens in the vocabulary (padded up for sharding; the padding is masked out of the loss)",
    "hidden_size": "the width of the residual stream",
    "intermediate_size": "the hidden size of the SwiGLU MLP (MoE families: of the dense layers, Mixtral's: of each "
    "expert)",
    "num_hidden_layers": "decoder layers",
    "num_attention_heads": "query heads",
    "num_key_value_heads": "key / value heads (grouped-query attention when fewer than the query heads)",
    "head_dim": "the size of one head; None: hidden_size // num_attention_heads",
    "rms_norm_eps": "epsilon of the RMS norms",
    "rope_theta": "the base of the rotary position embedding",
    "rope_scaling.rope_type": "default (plain RoPE), linear (positions divided by factor), llama3 (Llama 3.1's "
    "frequency scaling) or yarn (YaRN, DeepSeek-V3 and gpt-oss only); the fields below are read by the type they name",
    "rope_scaling.factor": "linear, llama3, yarn: the context extension factor",
    "rope_scaling.low_freq_factor": "llama3: wavelengths above original / low_freq_factor are scaled by factor",
    "rope_scaling.high_freq_factor": "llama3: wavelengths below original / high_freq_factor are kept",
    "rope_scaling.original_max_position_embeddings": "llama3, yarn: the context length before extension",
    "rope_scaling.beta_fast": "yarn: rotary dims turning more than this many times over the original context keep "
    "their frequency",
    "rope_scaling.beta_slow": "yarn: rotary dims turning fewer times than this are slowed by factor (a linear ramp "
    "between)",
    "rope_scaling.mscale": "yarn: with mscale_all_dim, cos and sin are scaled by mscale(factor, mscale) / "
    "mscale(factor, mscale_all_dim), mscale(f, m) = 0.1 m ln f + 1; 0: by mscale(factor, 1)",
    "rope_scaling.mscale_all_dim": "yarn: the attention scores are also scaled by mscale(factor, mscale_all_dim)² "
    "(0: not)",
    "max_position_embeddings": "the longest sequence the model is meant for (train.seq_len may not exceed it)",
    "tie_word_embeddings": "the LM head is the embedding's transpose",
    "initializer_range": "standard deviation of the normal initialisation",
    "num_local_experts": "routed experts per MoE layer",
    "num_experts": "routed experts per MoE layer",
    "num_experts_per_tok": "experts each token is routed to (top-k)",
    "moe_intermediate_size": "the hidden size of each routed expert",
    "shared_expert_intermediate_size": "the hidden size of the shared expert every token runs (gated by a sigmoid)",
    "norm_topk_prob": "renormalise the k routing weights to sum to 1",
    "decoder_sparse_step": "layer i is MoE when (i + 1) is a multiple of this (and i is not in mlp_only_layers)",
    "mlp_only_layers": "layers with a dense MLP instead of experts",
    "qkv_bias": "biases on the q, k and v projections",
    "router_aux_loss_coef": "weight of the load-balancing loss (transformers' load_balancing_loss_func)",
    "router_z_loss_coef": "weight of the router z-loss (0: none)",
    "capacity_factor": "0: dropless; > 0: each expert takes at most ceil(seq_len * k / E * factor) tokens of each "
    "sequence and drops the rest",
    "scoring_func": "router scores: softmax (transformers' MoE families) or sigmoid (DeepSeek-V3)",
    "router_bias_update_rate": "> 0: loss-free load balancing, a per-expert router bias moved by this much per step",
    "q_lora_rank": "multi-head latent attention: the query latent's size; None: queries projected directly",
    "kv_lora_rank": "multi-head latent attention: the key / value latent's size (what a decode cache holds per token)",
    "qk_rope_head_dim": "the rotary part of each query and key head (the key's shared by all heads)",
    "qk_nope_head_dim": "the part of each query and key head without position",
    "v_head_dim": "the size of one value head",
    "rope_interleave": "RoPE rotates adjacent dims (0, 1), (2, 3), ... of the rotary part (DeepSeek's weights)",
    "first_k_dense_replace": "the first this many layers have a dense MLP, the rest route",
    "n_routed_experts": "routed experts per MoE layer",
    "n_shared_experts": "shared experts every token runs (one SwiGLU of n × moe_intermediate_size), ungated",
    "n_group": "the routed experts form this many equal groups",
    "topk_group": "each token picks its experts among those of its this-many best groups (a group scores its two "
    "best experts)",
    "routed_scaling_factor": "the routed experts' combine weights are multiplied by this",
    "num_nextn_predict_layers": "multi-token prediction modules after the last layer (depth k predicts token i + k + "
    "1); trained with weight train.mtp_loss_weight, never run at inference",
    # The attention pattern's keys (`jaxpar.models.attention_pattern`) and Gemma 3's own.
    **PATTERN_MEANINGS,
    "sliding_window_pattern": "with layer_types empty: every this-many-th layer is full, the others sliding (Gemma)",
    "rope_local_base_freq": "the RoPE base of the sliding-window layers (rope_theta and rope_scaling: the full ones')",
    "final_logit_softcapping": "the LM head's logits become cap · tanh(logits / cap); None: not capped",
    # gpt-oss's own.
    "attention_bias": "biases on the q, k, v and o projections",
    "swiglu_alpha": "gpt-oss's experts: the sigmoid's gain in gate · sigmoid(alpha · gate)",
    "swiglu_limit": "gpt-oss's experts: the gate is clamped above at this, the up projection to [-limit, limit], and "
    "the hidden state is (up + 1) · gate · sigmoid(alpha · gate)",
    "rope_scaling.truncate": "yarn: round the ramp's ends out to whole rotary dims (transformers' default; gpt-oss: "
    "false)",
}
