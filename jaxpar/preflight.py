"""Config validation before anything is traced or compiled.

`check(config, num_devices)` raises `ConfigError` listing every problem, one line each, each naming
the config key to change. It only does arithmetic on the config: no jax tracing, no file reads
beyond existence checks.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from jaxpar.config import MESH_AXES, base_config
from jaxpar.mesh import MeshError, resolve_mesh_shape
from jaxpar.data.sources import validate_data_config
from jaxpar.models.layers import head_dim_of, padded_vocab_size
from jaxpar.models.llama import REMAT_POLICIES
from jaxpar.sharding import kv_heads_shardable

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "llama3")

# Extra checks registered by other model families / parallelism modules: fn(config, mesh_sizes) -> [str].
EXTRA_CHECKS = []
# Per-model_type schema of `config.model` (model_type -> ConfigDict of defaults).
MODEL_SCHEMAS = {}


class ConfigError(ValueError):
    """One or more config problems, one line each."""


def _unknown_keys(config, schema, prefix="") -> list[str]:
    errors = []
    for key in config.keys():
        path = f"{prefix}{key}"
        if key not in schema:
            errors.append(f"{path}: unknown config key (known here: {', '.join(sorted(schema.keys()))})")
        elif isinstance(schema[key], ConfigDict) and isinstance(config[key], ConfigDict):
            errors.extend(_unknown_keys(config[key], schema[key], path + "."))
    return errors


def _schema(config) -> ConfigDict:
    from jaxpar.config import llama_model_config

    schema = base_config()
    model_type = config.model.get("model_type", "llama")
    schema.model = MODEL_SCHEMAS.get(model_type, llama_model_config)()
    return schema


def _divides(errors, what: str, n: int, by: int, by_what: str):
    if by > 0 and n % by:
        errors.append(f"{what}={n} is not divisible by {by_what}={by}; change {what} or {by_what}")


def check_model(model, tensor: int) -> list[str]:
    errors = []
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    _divides(errors, "model.num_attention_heads", heads, kv, "model.num_key_value_heads")
    _divides(errors, "model.num_attention_heads", heads, tensor, "mesh.tensor")
    if not kv_heads_shardable(kv, tensor):
        _divides(errors, "mesh.tensor", tensor, kv, "model.num_key_value_heads")
    _divides(errors, "model.intermediate_size", model.intermediate_size, tensor, "mesh.tensor")
    if model.vocab_size <= 0:
        errors.append("model.vocab_size must be positive")
    else:
        _divides(errors, f"padded vocab (model.vocab_size={model.vocab_size} → {padded_vocab_size(model.vocab_size)})",
                 padded_vocab_size(model.vocab_size), tensor, "mesh.tensor")
    if model.head_dim is None and model.hidden_size % heads:
        errors.append(f"model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads={heads}; set model.head_dim")
    elif head_dim_of(model) % 2:
        errors.append(f"head dim {head_dim_of(model)} must be even for RoPE; change model.head_dim")
    rope_type = model.rope_scaling.rope_type
    if rope_type not in ROPE_TYPES:
        errors.append(f"model.rope_scaling.rope_type={rope_type!r} is not one of {ROPE_TYPES}")
    return errors


def check(config, num_devices: int) -> dict[str, int]:
    """Validates `config` for `num_devices`; returns the resolved mesh sizes."""
    errors = _unknown_keys(config, _schema(config))
    try:
        mesh = resolve_mesh_shape(config.mesh, num_devices)
    except MeshError as e:
        errors.append(str(e))
        mesh = {name: max(1, int(config.mesh.get(name, 1))) for name in MESH_AXES}
    if errors:  # unknown keys or a bad mesh make the rest meaningless
        raise ConfigError("\n".join(errors))

    train, parallel = config.train, config.parallel
    replicas = mesh["data"] * mesh["expert"]
    _divides(errors, "train.global_batch_size", train.global_batch_size, replicas * train.grad_accum,
             "mesh.data × mesh.expert × train.grad_accum")
    if train.grad_accum < 1:
        errors.append(f"train.grad_accum={train.grad_accum} must be >= 1")
    errors += check_model(config.model, mesh["tensor"])
    if parallel.zero_stage not in (0, 1, 3):
        errors.append(f"parallel.zero_stage={parallel.zero_stage} must be 0, 1 or 3")
    elif parallel.zero_stage >= 1:
        _divides(errors, "model.hidden_size", config.model.hidden_size, mesh["data"], "mesh.data (ZeRO shards the embed dim)")
    if parallel.sequence_parallel:
        _divides(errors, "train.seq_len", train.seq_len, mesh["tensor"], "mesh.tensor (sequence_parallel)")
    if parallel.remat not in REMAT_POLICIES:
        errors.append(f"parallel.remat={parallel.remat!r} is not one of {tuple(REMAT_POLICIES)}")
    if parallel.attention_impl not in ("auto", "xla", "cudnn"):
        errors.append(f"parallel.attention_impl={parallel.attention_impl!r} is not one of ('auto', 'xla', 'cudnn')")
    for key in ("compute_dtype", "param_dtype"):
        if train[key] not in DTYPE_CHOICES:
            errors.append(f"train.{key}={train[key]!r} is not one of {DTYPE_CHOICES}")
    if train.seq_len > config.model.max_position_embeddings:
        errors.append(f"train.seq_len={train.seq_len} exceeds model.max_position_embeddings={config.model.max_position_embeddings}")
    for name in ("pipeline", "context"):
        if mesh[name] > 1 and name not in SUPPORTED_AXES:
            errors.append(f"mesh.{name}={mesh[name]}: {name} parallelism is not available yet; set mesh.{name}=1")
    errors += validate_data_config(config)
    for extra in EXTRA_CHECKS:
        errors += extra(config, mesh)
    if errors:
        raise ConfigError("\n".join(errors))
    return mesh


# Mesh axes beyond data/tensor/expert whose parallelism has landed (modules add themselves).
SUPPORTED_AXES = set()

# Model families' schemas and checks register themselves (MODEL_SCHEMAS, EXTRA_CHECKS) on import.
from jaxpar.models import mixtral_preflight  # noqa: E402,F401
from jaxpar.parallel import pipeline_preflight  # noqa: E402,F401
