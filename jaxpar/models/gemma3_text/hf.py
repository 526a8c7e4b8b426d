"""transformers' Gemma3ForCausalLM checkpoints (`model_type` gemma3_text): the family's adapter.

Llama's layer tensors plus QK-norm (`self_attn.q_norm` / `k_norm`) and the two norms around the
MLP (`pre_feedforward_layernorm`, `post_feedforward_layernorm`); every norm weight as stored (the
model scales by 1 + weight). RoPE per layer kind: transformers 5 writes `rope_parameters` with a
`full_attention` and a `sliding_attention` entry, older files `rope_theta` + `rope_scaling` (full
layers) and `rope_local_base_freq`; both are read, the first written. The layers' windows are not
tensors: they come from `sliding_window` and `layer_types` (`FromConfig`).

The released checkpoints are multimodal (`MULTIMODAL`: Gemma3ForConditionalGeneration, model_type
gemma3): their text model is read from `text_config` and the `language_model` tensors (named
`language_model.model.*` in the released files and transformers 5's, `model.language_model.*` in
transformers 4.5x's), without the final logit soft-cap the multimodal class never applies; the
vision tower and the projector are not loaded. Saving writes the text model alone, as
Gemma3ForCausalLM.
"""

from __future__ import annotations

from jaxpar.models.attention_pattern import FULL, SLIDING, layer_kinds, layer_windows
from jaxpar.models.gemma3_text.schema import model_config as gemma3_config
from jaxpar.models.hf_adapter import (
    ATTENTION_AND_NORMS,
    LINEAR,
    Adapter,
    FromConfig,
    Weight,
    Wrapper,
    decoder_hf_fields,
    decoder_model_fields,
    reject_unsupported,
    rope_to_hf,
)

LAYER = {
    **ATTENTION_AND_NORMS,
    ("attention", "q_norm", "weight"): Weight("self_attn.q_norm.weight"),
    ("attention", "k_norm", "weight"): Weight("self_attn.k_norm.weight"),
    ("attention", "window"): FromConfig(lambda cfg, layer: layer_windows(cfg)[layer : layer + 1]),
    ("pre_feedforward_norm", "weight"): Weight("pre_feedforward_layernorm.weight"),
    ("post_feedforward_norm", "weight"): Weight("post_feedforward_layernorm.weight"),
    ("mlp", "gate"): Weight("mlp.gate_proj.weight", LINEAR),
    ("mlp", "up"): Weight("mlp.up_proj.weight", LINEAR),
    ("mlp", "down"): Weight("mlp.down_proj.weight", LINEAR),
}
SUPPORTED = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "use_bidirectional_attention": False}
# Gemma3TextConfig's defaults for keys a config.json may omit.
DEFAULTS = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)


def _ropes(hf: dict) -> tuple[dict, float]:
    """(the full layers' rope parameters with rope_theta, the sliding layers' base)."""
    per_kind = hf.get("rope_parameters") or {}
    if FULL in per_kind or SLIDING in per_kind:
        full = dict(per_kind.get(FULL) or {})
        local = (per_kind.get(SLIDING) or {}).get("rope_theta", DEFAULTS["rope_local_base_freq"])
        if (per_kind.get(SLIDING) or {}).get("rope_type", "default") != "default":
            raise ValueError("config.json rope_parameters.sliding_attention: only rope_type 'default' is supported")
    else:
        full = dict(hf.get("rope_scaling") or {})
        local = hf.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"])
    full.setdefault("rope_theta", hf.get("rope_theta", DEFAULTS["rope_theta"]))
    return full, float(local)


def model_config(hf: dict):
    reject_unsupported(hf, SUPPORTED)
    if hf.get("attn_logit_softcapping") is not None:  # Gemma3Attention never passes it to the attention function
        raise ValueError(f"config.json attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not supported "
                         "(transformers' Gemma 3 does not apply it; only null)")
    full, local = _ropes(hf)
    flat = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    fields = decoder_model_fields({**flat, "rope_parameters": full}, default_eps=1e-6, default_theta=DEFAULTS["rope_theta"])
    fields["head_dim"] = fields["head_dim"] or DEFAULTS["head_dim"]
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    pattern = dict(
        sliding_window=int(hf.get("sliding_window") or DEFAULTS["sliding_window"]),
        sliding_window_pattern=int(hf.get("sliding_window_pattern") or DEFAULTS["sliding_window_pattern"]),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or DEFAULTS["query_pre_attn_scalar"]),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        rope_local_base_freq=local,
    )
    cfg = gemma3_config(**fields, **pattern)
    types = list(hf.get("layer_types") or [])
    if types and types != layer_kinds(cfg):  # kept only where the period does not say it
        cfg.layer_types = types
    return cfg


def hf_config(cfg) -> dict:
    fields = decoder_hf_fields(cfg)
    for key in ("hidden_act", "rope_theta", "rope_scaling", "rope_parameters"):
        fields.pop(key)
    full, _ = rope_to_hf(cfg)
    return dict(
        fields,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}},
        layer_types=layer_kinds(cfg),
        sliding_window=cfg.sliding_window,
        sliding_window_pattern=cfg.sliding_window_pattern,
        # Gemma3TextConfig types it int (released values are); a fraction is written as it is.
        query_pre_attn_scalar=int(scalar) if float(scalar := cfg.query_pre_attn_scalar).is_integer() else scalar,
        attn_logit_softcapping=cfg.attn_logit_softcapping,
        final_logit_softcapping=cfg.final_logit_softcapping,
        attention_bias=False,
        use_bidirectional_attention=False,
    )


# Gemma3TextConfig's defaults (the family schema's) for the keys a released file's `text_config` omits.
TEXT_DEFAULTS = {key: gemma3_config()[key] for key in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "tie_word_embeddings",
)}
MULTIMODAL = Wrapper(
    "gemma3", "Gemma3ForConditionalGeneration", "text_config",
    renamed={"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."},
    ignored=("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector."),
    defaults=TEXT_DEFAULTS,
    # Gemma3ForConditionalGeneration never applies text_config's final soft-cap (Gemma3ForCausalLM
    # does); the released files leave it null.
    overrides={"final_logit_softcapping": None},
)
ADAPTER = Adapter("Gemma3ForCausalLM", model_config, hf_config, LAYER, wrappers=(MULTIMODAL,))
