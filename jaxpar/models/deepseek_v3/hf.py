"""transformers' DeepseekV3ForCausalLM checkpoints, in DeepSeek-V3's own layout: the family's adapter.

Per layer: the block's norms; MLA's `self_attn.q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`),
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj` (per head: the key's nope rows, then the
value's) and `o_proj`; a dense layer's `mlp.{gate,up,down}_proj`, a routed layer's router
`mlp.gate.weight` with its `mlp.gate.e_score_correction_bias`, experts per expert (or fused, as
transformers 5 keeps them in memory) and `mlp.shared_experts.*`. The multi-token prediction module
of depth d is layer `num_hidden_layers + d`: `enorm`, `hnorm`, `eh_proj`, a routed layer's tensors,
`shared_head.norm`, and copies of the embedding (`embed_tokens`) and LM head (`shared_head.head`),
as DeepSeek-V3's released weights hold them. transformers ignores those layers (and never writes
them), so a checkpoint without them loads with `num_nextn_predict_layers` = the modules it holds.
"""

from __future__ import annotations

from jaxpar.models.deepseek_v3.schema import ROPE_TYPES, dense_layers
from jaxpar.models.deepseek_v3.schema import model_config as deepseek_v3_config
from jaxpar.models.hf_adapter import (
    LINEAR,
    Adapter,
    Stack,
    Weight,
    expert_stacks,
    field,
    heads_in,
    heads_out,
    reject_inexpressible,
    reject_unsupported,
)

# What DeepSeek-V3 routes with; config.json names it (`scoring_func`, `topk_method`), transformers assumes it.
ROUTING = {"scoring_func": "sigmoid"}
SUPPORTED = {
    "hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
MLA = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
MOE = ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
YARN = ("factor", "beta_fast", "beta_slow")

NORMS = {
    ("input_norm", "weight"): Weight("input_layernorm.weight"),
    ("post_attention_norm", "weight"): Weight("post_attention_layernorm.weight"),
}
QUERY_DIRECT = {("attention", "q"): Weight("self_attn.q_proj.weight", heads_in(lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim))}
QUERY_LORA = {
    ("attention", "q_a"): Weight("self_attn.q_a_proj.weight", LINEAR),
    ("attention", "q_a_norm", "weight"): Weight("self_attn.q_a_layernorm.weight"),
    ("attention", "q_b"): Weight("self_attn.q_b_proj.weight", heads_in(lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim)),
}
KEYS_VALUES = {
    ("attention", "kv_a"): Weight("self_attn.kv_a_proj_with_mqa.weight", LINEAR),
    ("attention", "kv_a_norm", "weight"): Weight("self_attn.kv_a_layernorm.weight"),
    ("attention", "kv_b"): Weight("self_attn.kv_b_proj.weight", heads_in(lambda c: c.qk_nope_head_dim + c.v_head_dim)),
    ("attention", "o"): Weight("self_attn.o_proj.weight", heads_out(lambda c: c.v_head_dim)),
}
DENSE_MLP = {("mlp", p): Weight(f"mlp.{p}_proj.weight", LINEAR) for p in ("gate", "up", "down")}
ROUTED = {
    ("mlp", "router"): Weight("mlp.gate.weight", LINEAR),  # [E, D] <-> [D, E]
    ("mlp", "router_bias"): Weight("mlp.gate.e_score_correction_bias"),
    **expert_stacks("mlp.experts.{}.{}.weight", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
SHARED_EXPERTS = {("mlp", "shared_expert", p): Weight(f"mlp.shared_experts.{p}_proj.weight", LINEAR) for p in ("gate", "up", "down")}
PREDICTION = {
    ("enorm", "weight"): Weight("enorm.weight"),
    ("hnorm", "weight"): Weight("hnorm.weight"),
    ("eh_proj",): Weight("eh_proj.weight", LINEAR),  # [D, 2D] <-> [2D, D]
    ("norm", "weight"): Weight("shared_head.norm.weight"),
}


def layer_tables(cfg) -> tuple[dict, dict]:
    """(a routed layer's table, a dense layer's)."""
    attention = {**NORMS, **(QUERY_DIRECT if cfg.q_lora_rank is None else QUERY_LORA), **KEYS_VALUES}
    routed = {**attention, **ROUTED, **(SHARED_EXPERTS if cfg.n_shared_experts else {})}
    return routed, {**attention, **DENSE_MLP}


def _stacks(cfg) -> list[Stack]:
    routed_table, dense_table = layer_tables(cfg)
    layers, dense = cfg.num_hidden_layers, dense_layers(cfg)
    stacks = [Stack("layers", tuple(range(len(dense), layers)), routed_table)]
    if dense:
        stacks.append(Stack("dense_layers", dense, dense_table))
    if cfg.num_nextn_predict_layers:
        table = {**PREDICTION, **{("block",) + path: entry for path, entry in routed_table.items()}}
        stacks.append(Stack("mtp", tuple(range(layers, layers + cfg.num_nextn_predict_layers)), table))
    return stacks


def _copies(cfg) -> dict:
    """DeepSeek's MTP layers repeat the embedding and the LM head."""
    copies = {}
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        copies[f"model.layers.{i}.embed_tokens.weight"] = "model.embed_tokens.weight"
        copies[f"model.layers.{i}.shared_head.head.weight"] = "lm_head.weight"
    return copies


def _fit_to_tensors(cfg, names: set):
    """The prediction modules the checkpoint holds (transformers writes none)."""
    held = 0
    while held < cfg.num_nextn_predict_layers and f"model.layers.{cfg.num_hidden_layers + held}.eh_proj.weight" in names:
        held += 1
    cfg = cfg.copy_and_resolve_references()
    cfg.num_nextn_predict_layers = held
    return cfg


def rope_from_hf(hf: dict) -> tuple[float, dict]:
    """(rope_theta, rope_scaling) from transformers 5's `rope_parameters` or DeepSeek's `rope_scaling`."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
    scaling = deepseek_v3_config().rope_scaling.to_dict()
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
            raise ValueError("rope attention_factor and truncate=False are not supported (YaRN's defaults only)")
        scaling.update(factor=float(field(rope, "factor")), beta_fast=float(rope.get("beta_fast") or 32.0),
                       beta_slow=float(rope.get("beta_slow") or 1.0))
        # Absent (None) and 0 alike: transformers then takes YaRN's default attention factor.
        scaling.update(mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
        original = rope.get("original_max_position_embeddings") or field(hf, "max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling


def model_config(hf_config: dict):
    reject_unsupported(hf_config, SUPPORTED)
    theta, scaling = rope_from_hf(hf_config)
    q_lora = hf_config.get("q_lora_rank")
    depth = hf_config.get("num_nextn_predict_layers", hf_config.get("num_mtp_layers", 1))
    return deepseek_v3_config(
        **{key: int(field(hf_config, key)) for key in SIZES + MLA + MOE},
        num_key_value_heads=int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        initializer_range=float(hf_config.get("initializer_range", 0.02)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        rope_interleave=bool(hf_config.get("rope_interleave", True)),
        first_k_dense_replace=int(hf_config.get("first_k_dense_replace") or 0),
        n_shared_experts=int(hf_config.get("n_shared_experts") or 0),
        n_group=int(hf_config.get("n_group") or 1),
        topk_group=int(hf_config.get("topk_group") or 1),
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf_config.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=int(depth or 0),
    )


def hf_config(cfg) -> dict:
    reject_inexpressible(cfg, ROUTING)
    s = cfg.rope_scaling
    rope = {"rope_type": s.rope_type, "rope_theta": cfg.rope_theta}
    if s.rope_type == "yarn":
        rope.update({key: s[key] for key in YARN + ("mscale", "mscale_all_dim", "original_max_position_embeddings")})
    copied = SIZES + MLA + MOE + (
        "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "initializer_range",
        "q_lora_rank", "rope_interleave", "first_k_dense_replace", "n_shared_experts", "n_group", "topk_group",
        "norm_topk_prob", "routed_scaling_factor", "num_nextn_predict_layers",
    )
    return dict(
        {key: cfg[key] for key in copied},
        head_dim=cfg.qk_rope_head_dim,  # transformers' (the rotary part's size)
        hidden_act="silu",
        attention_bias=False,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_parameters=rope,
        torch_dtype="float32",
        dtype="float32",
    )


ADAPTER = Adapter(
    "DeepseekV3ForCausalLM", model_config, hf_config, {**NORMS, **QUERY_LORA, **KEYS_VALUES, **ROUTED, **SHARED_EXPERTS},
    stacks=_stacks, routing=ROUTING, copies=_copies,
    fit_to_tensors=_fit_to_tensors,
)
