"""transformers' MixtralForCausalLM checkpoints: the Mixtral family's adapter (`ADAPTER`).

Two on-disk layouts exist and both load:
- per expert (real Mixtral checkpoints, and what transformers 5's `save_pretrained` writes, converting
  from its fused in-memory layout): `model.layers.N.block_sparse_moe.gate.weight` [E, D] and
  `...block_sparse_moe.experts.E.{w1,w3,w2}.weight` (w1 gate [F, D], w3 up [F, D], w2 down [D, F]);
- fused (transformers 5's in-memory names, e.g. a raw `state_dict` dump): `model.layers.N.mlp.gate.weight`,
  `...mlp.experts.gate_up_proj` [E, 2F, D] (gate rows first) and `...mlp.experts.down_proj` [E, D, F].
`save` writes the per-expert layout, which every transformers version loads.
"""

from __future__ import annotations

from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    LINEAR,
    Adapter,
    FirstOf,
    decoder_hf_fields,
    decoder_model_fields,
    expert_stacks,
    field,
    reject_inexpressible,
    reject_unsupported,
)
from jaxpar.models.mixtral.schema import model_config as mixtral_config

MIXTRAL_DEFAULT_THETA = 1e6  # transformers' MixtralConfig default when config.json has none

LAYER = {
    **ATTENTION_AND_NORMS,
    # [E, D] router (transformers' `gate`) <-> [D, E].
    ("mlp", "router"): FirstOf(("block_sparse_moe.gate.weight", "mlp.gate.weight"), LINEAR),
    **expert_stacks("block_sparse_moe.experts.{}.{}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def model_config(hf_config: dict):
    reject_unsupported(hf_config, {"hidden_act": "silu"})
    window = hf_config.get("sliding_window")
    if window is not None and window < hf_config.get("max_position_embeddings", 0):
        raise ValueError(f"config.json sliding_window={window} is not supported (only null: full causal attention)")
    # router_jitter_noise and output_router_logits are ignored: jaxpar adds no router noise.
    fields = decoder_model_fields(hf_config, default_eps=1e-5, default_theta=MIXTRAL_DEFAULT_THETA)
    # MixtralConfig keeps head_dim null; `save` writes it out, so load it explicit either way.
    fields["head_dim"] = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
    return mixtral_config(
        **fields,
        num_local_experts=int(field(hf_config, "num_local_experts")),
        num_experts_per_tok=int(field(hf_config, "num_experts_per_tok")),
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
    )


def hf_config(cfg) -> dict:
    reject_inexpressible(cfg)
    return dict(
        decoder_hf_fields(cfg),
        num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


ADAPTER = Adapter("MixtralForCausalLM", model_config, hf_config, LAYER)
