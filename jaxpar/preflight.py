"""Config validation before anything is traced or compiled.

`check(config, num_devices)` raises `ConfigError` listing every problem, one line each, each naming
the config key to change. It only does arithmetic on the config: no jax tracing, no file reads
beyond existence checks. The checks themselves live with what they protect: the family record's
checks (`jaxpar.models.families`), each parallelism's module (`jaxpar.parallel.*`), the data
sources (`jaxpar.data.sources`); this module runs them all.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from jaxpar.axes import CONTEXT
from jaxpar.config import DTYPES, base_config
from jaxpar.data.sources import validate_data_config
from jaxpar.mesh import MeshError, resolve_mesh_shape
from jaxpar.models.families import UnknownFamily, family
from jaxpar.models.llama import REMAT_POLICIES
from jaxpar.models.options import ATTENTION_IMPLS
from jaxpar.parallel import data, tensor, zero
from jaxpar.parallel.pipeline import options as pipeline
from jaxpar.train import observe


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


def _choice(errors, key: str, value, choices):
    if value not in choices:
        errors.append(f"{key}={value!r} is not one of {tuple(choices)}")


def check(config, num_devices: int) -> dict[str, int]:
    """Validates `config` for `num_devices`; returns the resolved mesh sizes."""
    try:
        fam = family(config.model.get("model_type", "llama"))
    except UnknownFamily as e:
        raise ConfigError(str(e)) from None
    schema = base_config()
    schema.model = fam.schema()
    errors = _unknown_keys(config, schema)
    try:
        mesh = resolve_mesh_shape(config.mesh, num_devices)
    except MeshError as e:
        errors.append(str(e))
    if errors:  # unknown keys or a bad mesh make the rest meaningless
        raise ConfigError("\n".join(errors))

    train, parallel = config.train, config.parallel
    errors += data.checks(config, mesh)
    errors += fam.checks(config.model, mesh)
    errors += tensor.checks(config, mesh)
    errors += zero.checks(config, mesh)
    errors += pipeline.checks(config, mesh, has_aux_losses=fam.aux_losses is not None)
    _choice(errors, "parallel.remat", parallel.remat, ("auto", *REMAT_POLICIES))
    _choice(errors, "parallel.attention_impl", parallel.attention_impl, ATTENTION_IMPLS)
    for key in ("compute_dtype", "param_dtype"):
        _choice(errors, f"train.{key}", train[key], DTYPES)
    if train.seq_len > config.model.max_position_embeddings:
        errors.append(f"train.seq_len={train.seq_len} exceeds model.max_position_embeddings={config.model.max_position_embeddings}")
    if mesh[CONTEXT] > 1:
        errors.append(f"mesh.{CONTEXT}={mesh[CONTEXT]}: context parallelism is not available yet; set mesh.{CONTEXT}=1")
    errors += validate_data_config(config)
    errors += observe.checks(config)
    if errors:
        raise ConfigError("\n".join(errors))
    return mesh


__all__ = ["ConfigError", "check"]
