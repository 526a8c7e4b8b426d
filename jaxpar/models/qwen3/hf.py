"""transformers' Qwen3ForCausalLM checkpoints: the Qwen3 family's adapter (`ADAPTER`).

Llama's layer tensors plus `self_attn.q_norm.weight` / `self_attn.k_norm.weight` [head_dim].
Only full causal attention (no sliding window) and no attention biases, as in every released
Qwen3 checkpoint; other values are refused with a one-line error.
"""

from __future__ import annotations

from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    LINEAR,
    Adapter,
    Weight,
    decoder_hf_fields,
    decoder_model_fields,
    reject_unsupported,
)
from jaxpar.models.qwen3.schema import QWEN3_HEAD_DIM
from jaxpar.models.qwen3.schema import model_config as qwen3_config

QK_NORM = {
    ("attention", "q_norm", "weight"): Weight("self_attn.q_norm.weight"),
    ("attention", "k_norm", "weight"): Weight("self_attn.k_norm.weight"),
}
LAYER = {
    **ATTENTION_AND_NORMS,
    **QK_NORM,
    ("mlp", "gate"): Weight("mlp.gate_proj.weight", LINEAR),
    ("mlp", "up"): Weight("mlp.up_proj.weight", LINEAR),
    ("mlp", "down"): Weight("mlp.down_proj.weight", LINEAR),
}
# Keys of Qwen3's transformers configs jaxpar's models only support with these values.
SUPPORTED = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}


def reject_sliding_window(hf_config: dict) -> None:
    reject_unsupported(hf_config, SUPPORTED)
    if any(kind != "full_attention" for kind in hf_config.get("layer_types") or ()):
        raise ValueError("config.json layer_types other than full_attention are not supported (sliding window)")


def model_config(hf_config: dict):
    reject_sliding_window(hf_config)
    fields = decoder_model_fields(hf_config, default_eps=1e-6, default_theta=10000.0)
    fields["head_dim"] = fields["head_dim"] or QWEN3_HEAD_DIM
    return qwen3_config(**fields)


def hf_config(cfg) -> dict:
    return dict(decoder_hf_fields(cfg), attention_bias=False, use_sliding_window=False, sliding_window=None)


ADAPTER = Adapter("Qwen3ForCausalLM", model_config, hf_config, LAYER)
