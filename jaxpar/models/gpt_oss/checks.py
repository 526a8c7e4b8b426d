"""gpt-oss's config checks: the decoder's sizes (its RoPE under gpt-oss's own rope types), YaRN's
fields, the attention pattern's keys, the MoE keys and the clamped SwiGLU's; then the heads and
the experts' split over the expert mesh axis (`jaxpar.parallel.expert.checks`)."""

from __future__ import annotations

from jaxpar.models import moe
from jaxpar.models.attention_pattern import ranges as pattern_ranges
from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.models.gpt_oss.schema import ROPE_TYPES
from jaxpar.parallel import expert
from jaxpar.ranges import at_least, one_of, positive


def ranges(model) -> list[str]:
    rope = model.rope_scaling
    errors = one_of("model.rope_scaling.rope_type", rope.rope_type, ROPE_TYPES)
    # The shared decoder ranges know plain RoPE and llama3's: they see plain RoPE here, YaRN is checked below.
    plain = model.copy_and_resolve_references()
    plain.rope_scaling.rope_type = "default"
    errors += decoder_ranges(plain)
    if rope.rope_type == "yarn":
        for key in ("factor", "beta_fast", "beta_slow"):
            errors += positive(f"model.rope_scaling.{key}", rope[key])
        errors += at_least("model.rope_scaling.original_max_position_embeddings", rope.original_max_position_embeddings, 1)
    for key in ("swiglu_alpha", "swiglu_limit"):
        errors += positive(f"model.{key}", model[key])
    return errors + pattern_ranges(model) + moe.ranges(model, "num_local_experts")


def checks(model, mesh: dict) -> list[str]:
    return decoder_checks(model, mesh) + expert.checks(model.num_local_experts, mesh, "model.num_local_experts")
