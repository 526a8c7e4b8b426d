"""transformers' LlamaForCausalLM checkpoints: the Llama family's adapter (`ADAPTER`)."""

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
from jaxpar.models.llama.schema import model_config as llama_config

LAYER = {
    **ATTENTION_AND_NORMS,
    ("mlp", "gate"): Weight("mlp.gate_proj.weight", LINEAR),
    ("mlp", "up"): Weight("mlp.up_proj.weight", LINEAR),
    ("mlp", "down"): Weight("mlp.down_proj.weight", LINEAR),
}
# Keys of LlamaConfig jaxpar's Llama only supports with these values.
SUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def model_config(hf_config: dict):
    reject_unsupported(hf_config, SUPPORTED)
    return llama_config(**decoder_model_fields(hf_config, default_eps=1e-6, default_theta=10000.0))


def hf_config(cfg) -> dict:
    return dict(decoder_hf_fields(cfg), attention_bias=False, mlp_bias=False)


ADAPTER = Adapter("LlamaForCausalLM", model_config, hf_config, LAYER)
