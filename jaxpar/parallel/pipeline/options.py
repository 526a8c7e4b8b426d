"""Pipeline options from `config.parallel`, decided once, and the config checks they need."""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.axes import DATA, EXPERT, PIPELINE
from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1


def pipeline_options(config, mesh: dict) -> PipelineOptions | None:
    """None when the pipeline axis is 1. `parallel.num_microbatches` 0 means mesh.pipeline."""
    p = mesh[PIPELINE]
    if p == 1:
        return None
    parallel = config.parallel
    return PipelineOptions(parallel.pipeline_schedule, parallel.num_microbatches or p, parallel.virtual_stages)


def checks(config, mesh: dict, *, has_aux_losses: bool) -> list[str]:
    """One line per problem, each naming the key to change."""
    parallel, train, model = config.parallel, config.train, config.model
    errors = []
    name, v, m = parallel.pipeline_schedule, parallel.virtual_stages, parallel.num_microbatches
    if name not in SCHEDULE_NAMES:
        errors.append(f"parallel.pipeline_schedule={name!r} is not one of {SCHEDULE_NAMES}")
    if v < 1:
        errors.append(f"parallel.virtual_stages={v} must be >= 1")
    elif v > 1 and name != "interleaved_1f1b":
        errors.append(f"parallel.virtual_stages={v} needs parallel.pipeline_schedule='interleaved_1f1b' (got {name!r})")
    if m < 0:
        errors.append(f"parallel.num_microbatches={m} must be >= 1 (or 0: mesh.{PIPELINE})")
    p = mesh[PIPELINE]
    if p == 1 or errors:
        return errors
    m = m or p
    replicas = mesh[DATA] * mesh[EXPERT]
    if train.global_batch_size % (replicas * m):
        errors.append(
            f"parallel.num_microbatches={m} does not divide the per-replica batch "
            f"(train.global_batch_size={train.global_batch_size} / (mesh.{DATA} × mesh.{EXPERT})={replicas}); "
            "change parallel.num_microbatches or train.global_batch_size"
        )
    if train.grad_accum != 1:
        errors.append(
            f"train.grad_accum={train.grad_accum} must be 1 with mesh.{PIPELINE}={p}: "
            "the pipeline's parallel.num_microbatches already accumulates"
        )
    layers = model.num_hidden_layers
    if layers % (p * v):
        # The [L, ...] layer stack is split evenly over `pipeline` (see `layout`).
        errors.append(
            f"model.num_hidden_layers={layers} is not divisible by mesh.{PIPELINE} × parallel.virtual_stages={p * v}; "
            "uneven pipeline stages are not supported"
        )
    if name == "interleaved_1f1b" and m % p:
        errors.append(f"parallel.num_microbatches={m} must be a multiple of mesh.{PIPELINE}={p} for interleaved_1f1b")
    if has_aux_losses:
        errors.append(
            f"model.model_type={model.model_type!r} has auxiliary (router) losses, which the pipeline "
            f"engine does not carry yet; set mesh.{PIPELINE}=1"
        )
    return errors
