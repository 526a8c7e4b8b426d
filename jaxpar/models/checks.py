"""Config checks every decoder family shares: what a `config.model` section must satisfy on its
own. One line per problem, naming the key. Ranges come first: a size of 0 would make the
divisibility checks meaningless (or divide by zero), so a family's `checks` run only when its
`ranges` found nothing. A family's own checks (experts, ...) live in its folder; checks of a
parallelism's divisibilities live in its `jaxpar.parallel` module."""

from __future__ import annotations

from jaxpar.axes import PIPELINE
from jaxpar.model_facts import head_dim_of
from jaxpar.models.schema import ROPE_TYPES
from jaxpar.ranges import at_least, one_of, positive

SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings",
)


def decoder_ranges(model) -> list[str]:
    errors = []
    for key in SIZES:
        errors += at_least(f"model.{key}", model[key], 1)
    if model.head_dim is not None:
        errors += at_least("model.head_dim", model.head_dim, 1)
    for key in ("rms_norm_eps", "rope_theta", "initializer_range"):
        errors += positive(f"model.{key}", model[key])
    rope = model.rope_scaling
    errors += one_of("model.rope_scaling.rope_type", rope.rope_type, ROPE_TYPES)
    if rope.rope_type == "linear":
        errors += positive("model.rope_scaling.factor", rope.factor)
    if rope.rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            errors += positive(f"model.rope_scaling.{key}", rope[key])
        errors += at_least("model.rope_scaling.original_max_position_embeddings", rope.original_max_position_embeddings, 1)
        if rope.high_freq_factor <= rope.low_freq_factor:
            errors.append(
                f"model.rope_scaling.high_freq_factor={rope.high_freq_factor} must exceed "
                f"model.rope_scaling.low_freq_factor={rope.low_freq_factor}"
            )
    return errors


def decoder_checks(model, mesh: dict) -> list[str]:
    """Head divisibilities (run after `decoder_ranges` found nothing)."""
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
    return errors


def dense_layer_checks(dense: tuple[int, ...], num_layers: int, mesh: dict, keys: str) -> list[str]:
    """A MoE family's dense layers among its MoE layers (`Decoder.dense_layer_indices`, set by
    `keys`): at least one MoE layer must remain, and the pipeline engine stages one layer stack
    only (`jaxpar.models.decoder`)."""
    if len(dense) >= num_layers:
        return [f"{keys} leave no MoE layer among model.num_hidden_layers={num_layers}; use a dense family"]
    if dense and mesh[PIPELINE] > 1:
        return [
            f"{keys} put dense layers among the MoE layers, which mesh.{PIPELINE}={mesh[PIPELINE]} does not "
            f"support (the pipeline stages one layer stack); set mesh.{PIPELINE}=1 or make every layer MoE"
        ]
    return []
