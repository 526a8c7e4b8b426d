"""Qwen2-MoE's config checks: Qwen3-MoE's (`jaxpar.models.qwen3_moe.checks`) and the shared
expert's size (0: none)."""

from __future__ import annotations

from jaxpar.models.qwen3_moe import checks as qwen_moe
from jaxpar.ranges import at_least


def ranges(model) -> list[str]:
    return qwen_moe.ranges(model) + at_least("model.shared_expert_intermediate_size", model.shared_expert_intermediate_size, 0)


checks = qwen_moe.checks
