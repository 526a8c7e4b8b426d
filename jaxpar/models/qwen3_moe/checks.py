"""Qwen3-MoE's config checks (Qwen2-MoE's too): the decoder's, the MoE keys' ranges, the layer
pattern (`mlp_only_layers`, `decoder_sparse_step`: at least one MoE layer; no pipeline with dense
layers among them), and the experts' split over the expert mesh axis."""

from __future__ import annotations

from jaxpar.models import moe
from jaxpar.models.checks import decoder_checks, decoder_ranges, dense_layer_checks
from jaxpar.models.qwen3_moe.schema import dense_layers
from jaxpar.parallel import expert
from jaxpar.ranges import at_least

PATTERN_KEYS = "model.mlp_only_layers / model.decoder_sparse_step"


def ranges(model) -> list[str]:
    errors = decoder_ranges(model) + moe.ranges(model, "num_experts")
    errors += at_least("model.moe_intermediate_size", model.moe_intermediate_size, 1)
    errors += at_least("model.decoder_sparse_step", model.decoder_sparse_step, 1)
    layers = model.num_hidden_layers
    outside = [i for i in model.mlp_only_layers if not (isinstance(i, int) and 0 <= i < layers)]
    if outside:
        errors.append(f"model.mlp_only_layers has {outside}, not layer indices 0 .. {layers - 1}")
    return errors


def checks(model, mesh: dict) -> list[str]:
    errors = decoder_checks(model, mesh) + expert.checks(model.num_experts, mesh, "model.num_experts")
    return errors + dense_layer_checks(dense_layers(model), model.num_hidden_layers, mesh, PATTERN_KEYS)
