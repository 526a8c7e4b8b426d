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

from dataclasses import dataclass

import numpy as np

from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    LINEAR,
    Adapter,
    decoder_hf_fields,
    decoder_model_fields,
    field,
    reject_unsupported,
    span,
)
from jaxpar.models.mixtral.schema import model_config as mixtral_config

PER_EXPERT = "block_sparse_moe.experts.{}.{}.weight"
ROUTER = "block_sparse_moe.gate.weight"
FUSED_ROUTER = "mlp.gate.weight"
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"
MIXTRAL_DEFAULT_THETA = 1e6  # transformers' MixtralConfig default when config.json has none


@dataclass(frozen=True)
class Router:
    """[E, D] router (transformers' `gate`) <-> [D, E]."""

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        name = prefix + (ROUTER if get.has(prefix + ROUTER) else FUSED_ROUTER)
        return get(name).T

    def write(self, w, prefix: str, cfg) -> dict:
        return {prefix + ROUTER: w.T}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        name = prefix + (ROUTER if get.has(prefix + ROUTER) else FUSED_ROUTER)
        return LINEAR.block(get, name, cfg, index, shape)

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        return [{prefix + name: tuple(reversed(shape))} for name in (ROUTER, FUSED_ROUTER)]


@dataclass(frozen=True)
class ExpertStack:
    """One projection of all of a layer's experts <-> jaxpar's [E, in, out] (w1 gate, w3 up, w2 down)."""

    hf_name: str  # w1 | w3 | w2

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        if get.has(prefix + PER_EXPERT.format(0, self.hf_name)):
            return np.stack([get(prefix + PER_EXPERT.format(e, self.hf_name)).T for e in range(cfg.num_local_experts)])
        if self.hf_name == "w2":
            return get(prefix + FUSED_DOWN).transpose(0, 2, 1)
        fused, f = get(prefix + FUSED_GATE_UP), cfg.intermediate_size
        if fused.shape[1] != 2 * f:
            raise ValueError(f"{prefix + FUSED_GATE_UP} {fused.shape} does not fit intermediate_size={f}")
        half = fused[:, :f] if self.hf_name == "w1" else fused[:, f:]
        return half.transpose(0, 2, 1)

    def write(self, w, prefix: str, cfg) -> dict:
        return {prefix + PER_EXPERT.format(e, self.hf_name): w[e].T for e in range(w.shape[0])}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        if not get.has(prefix + PER_EXPERT.format(0, self.hf_name)):
            return self.read(get, prefix, cfg)[index]  # fused: one layer's tensor, then the block
        e0, e1 = span(index[0], shape[0])
        names = [prefix + PER_EXPERT.format(e, self.hf_name) for e in range(e0, e1)]
        return np.stack([LINEAR.block(get, n, cfg, index[1:], shape[1:]) for n in names])

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        experts, d_in, d_out = shape
        per_expert = {prefix + PER_EXPERT.format(e, self.hf_name): (d_out, d_in) for e in range(experts)}
        if self.hf_name == "w2":  # down [E, F, D]: fused [E, D, F]
            return [per_expert, {prefix + FUSED_DOWN: (experts, d_out, d_in)}]
        return [per_expert, {prefix + FUSED_GATE_UP: (experts, 2 * d_out, d_in)}]


LAYER = {
    **ATTENTION_AND_NORMS,
    ("mlp", "router"): Router(),
    ("mlp", "experts", "gate"): ExpertStack("w1"),
    ("mlp", "experts", "up"): ExpertStack("w3"),
    ("mlp", "experts", "down"): ExpertStack("w2"),
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
    return dict(
        decoder_hf_fields(cfg),
        num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


ADAPTER = Adapter("MixtralForCausalLM", model_config, hf_config, LAYER)
