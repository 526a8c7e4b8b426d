"""Mixtral's config checks: the decoder's, the MoE keys' ranges (`jaxpar.models.moe.ranges`), and
the experts' split over the expert mesh axis (`jaxpar.parallel.expert.checks`)."""

from __future__ import annotations

from jaxpar.models import moe
from jaxpar.models.checks import decoder_checks, decoder_ranges
from jaxpar.parallel import expert


def ranges(model) -> list[str]:
    return decoder_ranges(model) + moe.ranges(model, "num_local_experts")


def checks(model, mesh: dict) -> list[str]:
    return decoder_checks(model, mesh) + expert.checks(model.num_local_experts, mesh, "model.num_local_experts")
