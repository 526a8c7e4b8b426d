"""The tiny configs the tests build on: one place instead of a near-copy per test file."""

from __future__ import annotations

import copy

from jaxpar.axes import MESH_AXES
from jaxpar.config import base_config
from jaxpar.models.deepseek_v3 import model_config as deepseek_v3_model_config
from jaxpar.models.gemma3_text import model_config as gemma3_text_model_config
from jaxpar.models.gpt_oss import model_config as gpt_oss_model_config
from jaxpar.models.llama import model_config as llama_model_config
from jaxpar.models.mixtral import model_config as mixtral_model_config
from jaxpar.models.qwen2_moe import model_config as qwen2_moe_model_config
from jaxpar.models.qwen3 import model_config as qwen3_model_config
from jaxpar.models.qwen3_moe import model_config as qwen3_moe_model_config

# 8 query heads over 2 KV heads (fewer than tensor = 4 or 8: replicated), vocab 250 (padded to 256).
LLAMA = dict(
    vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)
MIXTRAL = dict(
    LLAMA, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.05,
    router_z_loss_coef=0.01,
)
# The Qwen families on Llama's sizes (head_dim 16 is already independent of 64 / 8 heads).
QWEN3 = dict(LLAMA)
# Fine-grained: 16 experts of 32, top-4 (4 per expert rank at expert = 4), probabilities not renormalised.
QWEN3_MOE = dict(
    LLAMA, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=False,
    router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
)
QWEN2_MOE = dict(
    LLAMA, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    norm_topk_prob=False, router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
)
# DeepSeek-V3 on Llama's width: MLA with 8 heads (q and k heads of 16 + 8, values of 16: padded to 24),
# a q latent of 32 and a kv latent of 16, YaRN; a dense layer then two routed ones with 16 experts in
# 4 groups (top-4 within 2 groups), one shared expert; one multi-token prediction module.
DEEPSEEK_V3 = dict(
    vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=64, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
    moe_intermediate_size=32, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    num_nextn_predict_layers=1, router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
    rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0),
)
# gpt-oss on Llama's sizes: 8 experts of 32, top-2, every bias, sinks, YaRN, a window of 4 (shorter
# than the tests' sequences) on layers 0, 2, ...; the SwiGLU clamp at 2 so that it acts.
GPT_OSS = dict(
    LLAMA, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4, swiglu_limit=2.0,
    router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
)
# Gemma 3 on Llama's sizes: layers sliding, sliding, full (a 4-token window, under seq_len 16), the
# full layer with linear RoPE scaling, scores scaled by 24^-1/2.
GEMMA3_TEXT = dict(
    LLAMA, num_hidden_layers=3, sliding_window=4, sliding_window_pattern=3, query_pre_attn_scalar=24.0,
    rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=2.0),
)
TRAIN = dict(global_batch_size=16, seq_len=16, steps=3, learning_rate=1e-2, warmup_steps=0)


def _config(model_section, train: dict | None):
    c = base_config()
    c.model = model_section
    c.train.update({**TRAIN, **(train or {})})
    return c


def llama(train: dict | None = None, **model):
    """A 2-layer Llama config (override any `config.model` key; `train` overrides `config.train`)."""
    return _config(llama_model_config(**{**LLAMA, **model}), train)


def mixtral(train: dict | None = None, **model):
    """A 2-layer Mixtral with 8 experts, top-2, nonzero load-balancing and z-loss coefficients."""
    return _config(mixtral_model_config(**{**MIXTRAL, **model}), train)


def qwen3(train: dict | None = None, **model):
    """A 2-layer Qwen3 (QK-norm, head_dim independent of hidden / heads)."""
    return _config(qwen3_model_config(**{**QWEN3, **model}), train)


def qwen3_moe(train: dict | None = None, **model):
    """A 2-layer Qwen3-MoE with 16 experts, top-4, unnormalised top-k weights."""
    return _config(qwen3_moe_model_config(**{**QWEN3_MOE, **model}), train)


def qwen2_moe(train: dict | None = None, **model):
    """A 2-layer Qwen2-MoE: 8 experts, top-2, a shared expert, q/k/v biases."""
    return _config(qwen2_moe_model_config(**{**QWEN2_MOE, **model}), train)


def deepseek_v3(train: dict | None = None, **model):
    """A DeepSeek-V3 of one dense and two routed layers (MLA, YaRN, group-limited routing) and one
    multi-token prediction module."""
    model = {**DEEPSEEK_V3, **model}
    scaling = deepseek_v3_model_config().rope_scaling.to_dict() | model.pop("rope_scaling")
    # Learning rate 1e-3, not 1e-2: Adam moves an element whose step-1 gradient is ~1e-8 by a good
    # part of the learning rate, differently on another mesh (tests/support/reference.py), and at 1e-2
    # that moved a near-tie of sigmoid selection scores: one of 3072 expert assignments of step 2
    # differed on data 2 x tensor 2 (measured), and its expert's weights by 3.5e-2.
    return _config(deepseek_v3_model_config(**model, rope_scaling=scaling), {"learning_rate": 1e-3, **(train or {})})


def gpt_oss(train: dict | None = None, **model):
    """A 2-layer gpt-oss (sliding then full) with 8 experts, top-2, sinks, biases and YaRN."""
    return _config(gpt_oss_model_config(**{**GPT_OSS, **model}), train)


def gemma3_text(train: dict | None = None, **model):
    """A 3-layer Gemma 3 text model (`GEMMA3_TEXT`: two sliding layers, then a full one)."""
    model = {**GEMMA3_TEXT, **model}
    scaling = gemma3_text_model_config().rope_scaling.to_dict() | model.pop("rope_scaling")
    return _config(gemma3_text_model_config(**model, rope_scaling=scaling), train)


def with_overrides(config, mesh: dict, **sections):
    """A copy of `config` with mesh sizes (unnamed axes → 1) and `section={key: value}` overrides."""
    config = copy.deepcopy(config)
    config.mesh.update({name: mesh.get(name, 1) for name in MESH_AXES})
    for section, values in sections.items():
        config[section].update(values)
    return config
