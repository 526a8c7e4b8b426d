"""Preflight for Mixtral configs: the `config.model` schema and MoE checks, registered with
`jaxpar.preflight` (which imports this module, so the registration is always in place)."""

from __future__ import annotations

from jaxpar import preflight
from jaxpar.config import mixtral_model_config


def check_moe(config, mesh: dict) -> list[str]:
    """One line per problem, each naming the key to change."""
    model = config.model
    if model.get("model_type") != "mixtral":
        return []
    errors = []
    experts, top_k, ep = model.num_local_experts, model.num_experts_per_tok, mesh["expert"]
    if experts < 1:
        errors.append(f"model.num_local_experts={experts} must be >= 1")
    elif experts % ep:
        errors.append(
            f"model.num_local_experts={experts} is not divisible by mesh.expert={ep}; "
            "change model.num_local_experts or mesh.expert"
        )
    if not 1 <= top_k <= max(experts, 1):
        errors.append(f"model.num_experts_per_tok={top_k} must be between 1 and model.num_local_experts={experts}")
    for key in ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef"):
        if model[key] < 0:
            errors.append(f"model.{key}={model[key]} must be >= 0")
    return errors


def register() -> None:
    preflight.MODEL_SCHEMAS["mixtral"] = mixtral_model_config
    if check_moe not in preflight.EXTRA_CHECKS:
        preflight.EXTRA_CHECKS.append(check_moe)


register()
