"""Mixtral's config checks: the decoder's, the MoE keys' ranges, and the experts' split over the
expert mesh axis (`jaxpar.parallel.expert.checks`)."""

from __future__ import annotations

from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.parallel import expert
from jaxpar.ranges import at_least


def ranges(model) -> list[str]:
    errors = decoder_ranges(model)
    experts, top_k = model.num_local_experts, model.num_experts_per_tok
    errors += at_least("model.num_local_experts", experts, 1)
    if not 1 <= top_k <= max(experts, 1):
        errors.append(f"model.num_experts_per_tok={top_k} must be between 1 and model.num_local_experts={experts}")
    for key in ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef"):
        errors += at_least(f"model.{key}", model[key], 0)
    return errors


def checks(model, mesh: dict) -> list[str]:
    return decoder_checks(model, mesh) + expert.checks(model, mesh)
