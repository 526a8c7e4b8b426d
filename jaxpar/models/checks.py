"""Config checks of the model families: what a `config.model` section must satisfy on its own and
with the mesh axes only the family knows about (experts). One line per problem, naming the key.
Checks of a parallelism's own divisibilities live in its `jaxpar.parallel` module."""

from __future__ import annotations

from jaxpar.config import ROPE_TYPES, head_dim_of
from jaxpar.parallel import expert


def llama(model, mesh: dict) -> list[str]:
    del mesh
    errors = []
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads % kv:
        errors.append(
            f"model.num_attention_heads={heads} is not divisible by model.num_key_value_heads={kv}; "
            "change model.num_attention_heads or model.num_key_value_heads"
        )
    if model.head_dim is None and model.hidden_size % heads:
        errors.append(f"model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads={heads}; set model.head_dim")
    elif head_dim_of(model) % 2:
        errors.append(f"head dim {head_dim_of(model)} must be even for RoPE; change model.head_dim")
    rope_type = model.rope_scaling.rope_type
    if rope_type not in ROPE_TYPES:
        errors.append(f"model.rope_scaling.rope_type={rope_type!r} is not one of {ROPE_TYPES}")
    return errors


def mixtral(model, mesh: dict) -> list[str]:
    errors = llama(model, mesh)
    experts, top_k = model.num_local_experts, model.num_experts_per_tok
    if experts < 1:
        errors.append(f"model.num_local_experts={experts} must be >= 1")
    else:
        errors += expert.checks(model, mesh)
    if not 1 <= top_k <= max(experts, 1):
        errors.append(f"model.num_experts_per_tok={top_k} must be between 1 and model.num_local_experts={experts}")
    for key in ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef"):
        if model[key] < 0:
            errors.append(f"model.{key}={model[key]} must be >= 0")
    return errors
