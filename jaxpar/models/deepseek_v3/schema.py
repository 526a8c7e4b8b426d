"""DeepSeek-V3's `config.model` keys and defaults: DeepseekV3Config's names and defaults (the 671B
model, but for the optional `q_lora_rank`: None) over the shared decoder keys, plus jaxpar's own MoE
options (`jaxpar.models.moe.option_keys`, scoring "sigmoid" as DeepSeek-V3 routes).

Multi-head latent attention replaces the shared `head_dim` (there is none: queries and keys have
`qk_nope_head_dim + qk_rope_head_dim` per head, values `v_head_dim`), and RoPE has DeepSeek-V3's own
`rope_scaling` fields (YaRN's). The first `first_k_dense_replace` layers run a dense SwiGLU MLP of
`intermediate_size`, the rest route (`dense_layers`); `num_nextn_predict_layers` multi-token
prediction modules follow the last layer.
"""

import dataclasses

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from jaxpar.models import moe
from jaxpar.models.schema import decoder_config

ROPE_TYPES = ("default", "yarn")


def model_config(**overrides):
    """A DeepSeek-V3 `config.model` section (DeepseekV3Config's defaults)."""
    model = decoder_config(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,  # the dense layers' MLP
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,  # one key and value per head: MLA expands its latent per head
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    del model["head_dim"]
    # YaRN's fields (rope_type "yarn"); "default" reads none of them.
    model.rope_scaling = ConfigDict(
        dict(
            rope_type="default", factor=1.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.0,
        )
    )
    model.update(
        dict(
            # None: queries projected directly. An optional key, so its default is None (DeepseekV3Config's: 1536).
            q_lora_rank=placeholder(int),
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            rope_interleave=True,
            first_k_dense_replace=3,
            n_routed_experts=256,
            n_shared_experts=1,
            moe_intermediate_size=2048,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=0,
            router_aux_loss_coef=0.0,
            **moe.option_keys(),
        )
    )
    model.scoring_func = "sigmoid"
    model.update(overrides)
    return model


def dense_layers(model) -> tuple[int, ...]:
    """The first `first_k_dense_replace` layers (transformers' rule: layer i routes when
    i >= first_k_dense_replace)."""
    return tuple(range(min(model.first_k_dense_replace, model.num_hidden_layers)))


def moe_spec(model) -> moe.MoESpec:
    """The routed layers: sigmoid scores with the selection bias (`e_score_correction_bias`, present
    even when loss-free balancing does not move it), group-limited top-k, renormalised and scaled
    weights, and `n_shared_experts` ungated shared experts as one SwiGLU of their summed width."""
    spec = moe.spec_from(
        model, experts=model.n_routed_experts, expert_ffn=model.moe_intermediate_size,
        normalize_top_k=model.norm_topk_prob, shared_ffn=model.n_shared_experts * model.moe_intermediate_size,
    )
    return dataclasses.replace(
        spec, groups=model.n_group, top_groups=model.topk_group, routed_scale=float(model.routed_scaling_factor),
        shared_gate=False, selection_bias=True,
    )
