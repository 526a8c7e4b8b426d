"""DeepSeek-V3's config checks: sizes and ranges first (the decoder's sizes, MLA's ranks and head
sizes, YaRN's fields, the MoE keys), then what they must satisfy together: one key and value per
query head, experts in equal groups with enough of them in the kept groups for the top-k, at least
one MoE layer, the experts' split over the expert mesh axis. Any pipeline holds the dense layers
and the prediction modules (its end stages run them; the pipeline's own checks say what else)."""

from __future__ import annotations

from jaxpar.axes import PIPELINE
from jaxpar.models import moe
from jaxpar.models.checks import SIZES, dense_layer_checks
from jaxpar.models.deepseek_v3.schema import ROPE_TYPES, dense_layers
from jaxpar.parallel import expert
from jaxpar.ranges import at_least, one_of, positive, within

PATTERN_KEYS = "model.first_k_dense_replace"


def ranges(model) -> list[str]:
    errors = []
    for key in SIZES + ("kv_lora_rank", "v_head_dim", "moe_intermediate_size", "n_group", "topk_group"):
        errors += at_least(f"model.{key}", model[key], 1)
    for key in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
        errors += at_least(f"model.{key}", model[key], 0)
    if model.q_lora_rank is not None:
        errors += at_least("model.q_lora_rank", model.q_lora_rank, 1)
    errors += at_least("model.qk_rope_head_dim", model.qk_rope_head_dim, 2)
    if model.qk_rope_head_dim % 2:
        errors.append(f"model.qk_rope_head_dim={model.qk_rope_head_dim} must be even for RoPE")
    for key in ("rms_norm_eps", "rope_theta", "initializer_range", "routed_scaling_factor"):
        errors += positive(f"model.{key}", model[key])
    rope = model.rope_scaling
    errors += one_of("model.rope_scaling.rope_type", rope.rope_type, ROPE_TYPES)
    if rope.rope_type == "yarn":
        for key in ("factor", "beta_fast", "beta_slow"):
            errors += positive(f"model.rope_scaling.{key}", rope[key])
        for key in ("mscale", "mscale_all_dim"):
            errors += at_least(f"model.rope_scaling.{key}", rope[key], 0)
        errors += at_least("model.rope_scaling.original_max_position_embeddings", rope.original_max_position_embeddings, 1)
    errors += within("model.topk_group", model.topk_group, 1, max(model.n_group, 1))
    return errors + moe.ranges(model, "n_routed_experts")


def checks(model, mesh: dict) -> list[str]:
    errors = []
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if kv != heads:
        errors.append(
            f"model.num_key_value_heads={kv} must equal model.num_attention_heads={heads} (multi-head latent "
            "attention expands its latent into one key and value per head)"
        )
    experts, groups = model.n_routed_experts, model.n_group
    if experts % groups:
        errors.append(f"model.n_routed_experts={experts} is not divisible by model.n_group={groups}; change either")
    elif model.num_experts_per_tok > model.topk_group * (experts // groups):
        errors.append(
            f"model.num_experts_per_tok={model.num_experts_per_tok} exceeds the {model.topk_group * (experts // groups)} "
            "experts of the model.topk_group groups a token keeps; raise model.topk_group or lower the top-k"
        )
    errors += expert.checks(experts, mesh, "model.n_routed_experts")
    # The dense layers lead, so the pipeline's first stage runs them (`Decoder.run_stage`): only
    # the no-MoE-layer rule applies (their count within the stages: `jaxpar.parallel.pipeline.options`).
    return errors + dense_layer_checks(dense_layers(model), model.num_hidden_layers, {**mesh, PIPELINE: 1}, PATTERN_KEYS)
