"""transformers' GptOssForCausalLM checkpoints: the gpt-oss family's adapter (`ADAPTER`).

Per layer: the block's norms; `self_attn.{q,k,v,o}_proj.{weight,bias}` and `self_attn.sinks` [H];
the router `mlp.router.weight` [E, D] and `mlp.router.bias` [E]; the experts fused as transformers
keeps them, `mlp.experts.gate_up_proj` [E, D, 2F] whose columns interleave gate and up (gate at
even columns, up at odd), `mlp.experts.gate_up_proj_bias` [E, 2F] alike, `mlp.experts.down_proj`
[E, F, D] and `mlp.experts.down_proj_bias` [E, D] — bf16 or fp32 (what `save` writes, and
`save_pretrained`) — or, in the released checkpoints, the two projections as MXFP4
`mlp.experts.{gate_up,down}_proj_{blocks,scales}` ([E, out, in] once dequantized: `mxfp4`),
dequantized on load. Each layer's window is no tensor: it follows `layer_types`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from jaxpar.models.attention_pattern import SLIDING, layer_windows
from jaxpar.models.gpt_oss import mxfp4
from jaxpar.models.gpt_oss.schema import ROPE_TYPES, alternating
from jaxpar.models.gpt_oss.schema import model_config as gpt_oss_config
from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    COPY,
    LINEAR,
    Adapter,
    Layout,
    Stack,
    Weight,
    decoder_hf_fields,
    field,
    reject_inexpressible,
    reject_unsupported,
    span,
)

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
YARN = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate")
SUPPORTED = {"hidden_act": "silu", "attention_dropout": 0.0}


def _vector_heads(head_count: str) -> Layout:
    """A bias over heads: HF [heads * Dh] <-> jaxpar [heads, Dh]."""
    return Layout(
        lambda w, cfg: w.reshape(cfg[head_count], -1), lambda w, cfg: w.reshape(-1),
        lambda get, name, cfg, index, shape: _heads_bias_block(get, name, index, shape), lambda s, cfg: (s[0] * s[1],),
    )


def _heads_bias_block(get, name, index, shape):
    h0, h1 = span(index[0], shape[0])
    part = np.asarray(get.get_slice(name)[h0 * shape[1] : h1 * shape[1]], np.float32)
    return part.reshape(h1 - h0, shape[1])[:, index[1]]


@dataclass(frozen=True)
class Window:
    """A layer's window (`jaxpar.models.attention_layers.LayerWindow`): no tensor, the config's pattern."""

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        return layer_windows(cfg)[int(prefix.split(".")[2])].astype(np.float32)[None]

    def write(self, w, prefix: str, cfg) -> dict:
        return {}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        return self.read(get, prefix, cfg)[index]

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        return [{}]


@dataclass(frozen=True)
class ExpertPart:
    """One of the experts' leaves (`part`: gate, up, down, gate_bias, up_bias, down_bias) <-> its
    share of transformers' fused tensors. `gate` and `up` write their interleaved halves of one
    tensor, the other half zero: `jaxpar.interop.hf` sums the parts of a tensor written twice."""

    part: str

    def _fused(self) -> str:
        stem = "mlp.experts.down_proj" if self.part.startswith("down") else "mlp.experts.gate_up_proj"
        return stem + ("_bias" if self.part.endswith("_bias") else "")

    def _columns(self) -> slice | None:  # where the part lies on the fused tensor's last axis
        return None if self.part.startswith("down") else slice(0, None, 2) if self.part.startswith("gate") else slice(1, None, 2)

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        name = prefix + self._fused()
        if self.part.endswith("_bias") or get.has(name):
            fused = get(name)
        else:  # MXFP4: [E, out, in] once dequantized, transformers' [E, in, out] transposed
            fused = mxfp4.dequantize(get(name + "_blocks"), get(name + "_scales")).transpose(0, 2, 1)
        columns = self._columns()
        return fused if columns is None else fused[..., columns]

    def write(self, w, prefix: str, cfg) -> dict:
        columns = self._columns()
        if columns is None:
            return {prefix + self._fused(): w}
        w = jnp.asarray(w)
        fused = jnp.zeros(w.shape[:-1] + (2 * w.shape[-1],), w.dtype).at[..., columns].set(w)
        return {prefix + self._fused(): fused}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        return self.read(get, prefix, cfg)[index]  # one layer's experts, then the block

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        name = prefix + self._fused()
        fused = shape if self._columns() is None else shape[:-1] + (2 * shape[-1],)
        if self.part.endswith("_bias"):
            return [{name: fused}]
        experts, d_in, d_out = fused
        return [{name: fused}, {name + "_blocks": (experts, d_out, d_in // 32, 16), name + "_scales": (experts, d_out, d_in // 32)}]


LAYER = {
    **ATTENTION_AND_NORMS,
    ("attention", "q_bias"): Weight("self_attn.q_proj.bias", _vector_heads("num_attention_heads")),
    ("attention", "k_bias"): Weight("self_attn.k_proj.bias", _vector_heads("num_key_value_heads")),
    ("attention", "v_bias"): Weight("self_attn.v_proj.bias", _vector_heads("num_key_value_heads")),
    ("attention", "o_bias"): Weight("self_attn.o_proj.bias", COPY),
    ("attention", "sinks"): Weight("self_attn.sinks", COPY),
    ("attention", "window"): Window(),
    ("mlp", "router"): Weight("mlp.router.weight", LINEAR),  # [E, D] <-> [D, E]
    ("mlp", "logit_bias"): Weight("mlp.router.bias", COPY),
    **{("mlp", "experts", part): ExpertPart(part) for part in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")},
}
UNBIASED = {path: entry for path, entry in LAYER.items() if path[-1] not in ("q_bias", "k_bias", "v_bias", "o_bias")}


def _stacks(cfg) -> list[Stack]:
    return [Stack("layers", tuple(range(cfg.num_hidden_layers)), LAYER if cfg.attention_bias else UNBIASED)]


def rope_from_hf(hf: dict) -> tuple[float, dict]:
    """(rope_theta, rope_scaling) from transformers 5's `rope_parameters` or the released `rope_scaling`."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 150000.0)))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
    scaling = gpt_oss_config().rope_scaling.to_dict()
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ValueError("config.json rope attention_factor / mscale are not supported (YaRN's default attention factor only)")
        scaling.update(factor=float(field(rope, "factor")), beta_fast=float(rope.get("beta_fast") or 32.0),
                       beta_slow=float(rope.get("beta_slow") or 1.0), truncate=bool(rope.get("truncate", True)))
        original = rope.get("original_max_position_embeddings") or field(hf, "max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling


def model_config(hf_config: dict):
    reject_unsupported(hf_config, SUPPORTED)
    quantization = hf_config.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise ValueError(f"config.json quantization_config quant_method={quantization.get('quant_method')!r} is not "
                         "supported (only mxfp4, dequantized on load)")
    theta, scaling = rope_from_hf(hf_config)
    layers = int(field(hf_config, "num_hidden_layers"))
    window = hf_config.get("sliding_window")
    types = list(hf_config.get("layer_types") or alternating(layers))
    return gpt_oss_config(
        **{key: int(field(hf_config, key)) for key in SIZES},
        num_key_value_heads=int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
        head_dim=int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        initializer_range=float(hf_config.get("initializer_range", 0.02)),
        sliding_window=None if window is None or SLIDING not in types else int(window),
        layer_types=types,
        attention_bias=bool(hf_config.get("attention_bias", True)),
        num_local_experts=int(field(hf_config, "num_local_experts")),
        num_experts_per_tok=int(hf_config.get("num_experts_per_tok") or field(hf_config, "experts_per_token")),
        swiglu_alpha=float(hf_config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf_config.get("swiglu_limit", 7.0)),
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
    )


def hf_config(cfg) -> dict:
    reject_inexpressible(cfg)
    if not cfg.attention_sinks:
        raise ValueError("model.attention_sinks=False has no transformers equivalent (gpt-oss always has sinks); cannot save")
    plain = cfg.copy_and_resolve_references()  # the shared fields know plain RoPE and llama3's; YaRN's are below
    plain.rope_scaling = ConfigDict({"rope_type": "default"})
    fields = decoder_hf_fields(plain)
    s = cfg.rope_scaling
    rope = {"rope_type": s.rope_type, "rope_theta": cfg.rope_theta}
    if s.rope_type == "yarn":
        rope.update({key: s[key] for key in YARN})
    fields.update(rope_parameters=rope, rope_scaling=None)
    return dict(
        fields,
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        attention_bias=bool(cfg.attention_bias),
        attention_dropout=0.0,
        num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        swiglu_alpha=cfg.swiglu_alpha,
        swiglu_limit=cfg.swiglu_limit,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
    )


ADAPTER = Adapter("GptOssForCausalLM", model_config, hf_config, LAYER, stacks=_stacks)
