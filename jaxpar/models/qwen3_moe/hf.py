"""transformers' Qwen3MoeForCausalLM checkpoints: the Qwen3-MoE family's adapter (`ADAPTER`).

MoE layers: Qwen3's attention tensors (QK-norm included), the router `mlp.gate.weight` [E, D] and
the experts per expert, `mlp.experts.E.{gate,up,down}_proj.weight` (what `save_pretrained` writes
and what released checkpoints hold), or fused as transformers 5 keeps them in memory
(`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]). Dense layers
(`mlp_only_layers`, `decoder_sparse_step`) hold Qwen3's dense MLP tensors; they are the params'
second layer stack, `dense_layers` (`jaxpar.models.decoder`). Qwen2-MoE builds on these helpers.
"""

from __future__ import annotations

from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    LINEAR,
    Adapter,
    Stack,
    Weight,
    decoder_hf_fields,
    decoder_model_fields,
    expert_stacks,
    field,
    reject_inexpressible,
)
from jaxpar.models.qwen3.hf import LAYER as QWEN3_LAYER
from jaxpar.models.qwen3.hf import QK_NORM, reject_sliding_window
from jaxpar.models.qwen3_moe.schema import dense_layers
from jaxpar.models.qwen3_moe.schema import model_config as qwen3_moe_config

ROUTED = {
    ("mlp", "router"): Weight("mlp.gate.weight", LINEAR),  # [E, D] <-> [D, E]
    **expert_stacks("mlp.experts.{}.{}.weight", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
DENSE_MLP = {path: entry for path, entry in QWEN3_LAYER.items() if path[0] == "mlp"}
MOE_LAYER = {**ATTENTION_AND_NORMS, **QK_NORM, **ROUTED}
DENSE_LAYER = {**ATTENTION_AND_NORMS, **QK_NORM, **DENSE_MLP}


def layer_stacks(moe_table: dict, dense_table: dict):
    """`Adapter.stacks` of a Qwen MoE model: its MoE layers in "layers", its dense ones in "dense_layers"."""

    def stacks(cfg) -> list[Stack]:
        dense = dense_layers(cfg)
        routed = tuple(i for i in range(cfg.num_hidden_layers) if i not in dense)
        return [Stack("layers", routed, moe_table)] + ([Stack("dense_layers", dense, dense_table)] if dense else [])

    return stacks


def moe_fields(hf_config: dict) -> dict:
    """The MoE keys Qwen3MoeConfig and Qwen2MoeConfig share, with their defaults."""
    # transformers 5.24 writes Qwen3-MoE's expert count as num_local_experts; released
    # checkpoints (and Qwen2-MoE) name it num_experts.
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json lacks 'num_experts'")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(field(hf_config, "num_experts_per_tok")),
        moe_intermediate_size=int(field(hf_config, "moe_intermediate_size")),
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf_config.get("decoder_sparse_step", 1)),
        mlp_only_layers=[int(i) for i in hf_config.get("mlp_only_layers") or []],
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
    )


def moe_hf_fields(cfg) -> dict:
    reject_inexpressible(cfg)
    keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")
    return dict(
        {key: cfg[key] for key in keys + ("router_aux_loss_coef",)},
        mlp_only_layers=list(cfg.mlp_only_layers),
        output_router_logits=False,
        use_sliding_window=False,
    )


def model_config(hf_config: dict):
    reject_sliding_window(hf_config)
    fields = decoder_model_fields(hf_config, default_eps=1e-6, default_theta=10000.0)
    # The config class has no head_dim (hidden / heads unless config.json names one); `save`
    # writes it out, so load it explicit either way.
    fields["head_dim"] = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
    return qwen3_moe_config(**fields, **moe_fields(hf_config))


def hf_config(cfg) -> dict:
    return dict(decoder_hf_fields(cfg), **moe_hf_fields(cfg), attention_bias=False, sliding_window=None)


ADAPTER = Adapter("Qwen3MoeForCausalLM", model_config, hf_config, MOE_LAYER, stacks=layer_stacks(MOE_LAYER, DENSE_LAYER))
