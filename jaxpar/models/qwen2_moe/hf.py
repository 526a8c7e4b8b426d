"""transformers' Qwen2MoeForCausalLM checkpoints: the Qwen2-MoE family's adapter (`ADAPTER`).

Qwen3-MoE's layout (`jaxpar.models.qwen3_moe.hf`) without QK-norm, with `self_attn.{q,k,v}_proj.bias`
(`qkv_bias`) and per MoE layer the shared expert `mlp.shared_expert.{gate,up,down}_proj.weight`
and its gate `mlp.shared_expert_gate.weight` [1, D].
"""

from __future__ import annotations

from jaxpar.model_facts import head_dim_of
from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    LINEAR,
    Adapter,
    Layout,
    Weight,
    decoder_hf_fields,
    decoder_model_fields,
    reject_unsupported,
    rows_cols,
    span,
)
from jaxpar.models.qwen2_moe.schema import model_config as qwen2_moe_config
from jaxpar.models.qwen3_moe.hf import DENSE_MLP, ROUTED, layer_stacks, moe_fields, moe_hf_fields


def _bias_block(get, name, cfg, index, shape):  # jaxpar [heads, Dh] from HF [heads * Dh]
    dh = head_dim_of(cfg)
    h0, h1 = span(index[0], shape[0])
    return rows_cols(get, name, (h0 * dh, h1 * dh), None).reshape(-1, dh)[:, index[1]]


# A q/k/v bias: [heads * Dh] <-> [heads, Dh].
HEADS_BIAS = Layout(
    lambda w, cfg: w.reshape(-1, head_dim_of(cfg)), lambda w, cfg: w.reshape(-1), _bias_block,
    lambda s, cfg: (s[0] * s[1],),
)
BIASES = {("attention", f"{p}_bias"): Weight(f"self_attn.{p}_proj.bias", HEADS_BIAS) for p in "qkv"}
SHARED_EXPERT = {
    ("mlp", "shared_expert", "gate"): Weight("mlp.shared_expert.gate_proj.weight", LINEAR),
    ("mlp", "shared_expert", "up"): Weight("mlp.shared_expert.up_proj.weight", LINEAR),
    ("mlp", "shared_expert", "down"): Weight("mlp.shared_expert.down_proj.weight", LINEAR),
    ("mlp", "shared_expert_gate"): Weight("mlp.shared_expert_gate.weight", LINEAR),  # [1, D] <-> [D, 1]
}


def _stacks(cfg):
    attention = {**ATTENTION_AND_NORMS, **(BIASES if cfg.qkv_bias else {})}
    return layer_stacks({**attention, **ROUTED, **SHARED_EXPERT}, {**attention, **DENSE_MLP})(cfg)


def model_config(hf_config: dict):
    reject_unsupported(hf_config, {"hidden_act": "silu", "use_sliding_window": False})
    fields = decoder_model_fields(hf_config, default_eps=1e-6, default_theta=10000.0)
    # The config class has no head_dim (hidden / heads unless config.json names one); `save`
    # writes it out, so load it explicit either way.
    fields["head_dim"] = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
    return qwen2_moe_config(
        **fields, **moe_fields(hf_config),
        shared_expert_intermediate_size=int(hf_config.get("shared_expert_intermediate_size", 5632)),
        qkv_bias=bool(hf_config.get("qkv_bias", True)),
    )


def hf_config(cfg) -> dict:
    return dict(
        decoder_hf_fields(cfg), **moe_hf_fields(cfg),
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=bool(cfg.qkv_bias),
    )


ADAPTER = Adapter(
    "Qwen2MoeForCausalLM", model_config, hf_config, {**ATTENTION_AND_NORMS, **BIASES, **ROUTED, **SHARED_EXPERT},
    stacks=_stacks,
)
