"""Preflight for pipeline parallelism: config arithmetic only, registered with `jaxpar.preflight`
(which imports this module, so the registration is always in place)."""

from __future__ import annotations

from jaxpar import preflight
from jaxpar.parallel.schedules import SCHEDULE_NAMES


def check_pipeline(config, mesh: dict) -> list[str]:
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
        errors.append(f"parallel.num_microbatches={m} must be >= 1 (or 0: mesh.pipeline)")
    p = mesh["pipeline"]
    if p == 1 or errors:
        return errors
    m = m or p
    replicas = mesh["data"] * mesh["expert"]
    if train.global_batch_size % (replicas * m):
        errors.append(
            f"parallel.num_microbatches={m} does not divide the per-replica batch "
            f"(train.global_batch_size={train.global_batch_size} / (mesh.data × mesh.expert)={replicas}); "
            "change parallel.num_microbatches or train.global_batch_size"
        )
    if train.grad_accum != 1:
        errors.append(
            f"train.grad_accum={train.grad_accum} must be 1 with mesh.pipeline={p}: "
            "the pipeline's parallel.num_microbatches already accumulates"
        )
    layers = model.num_hidden_layers
    if layers % (p * v):
        # Uneven stages are not supported: the [L, ...] layer stack is split evenly over `pipeline`.
        errors.append(
            f"model.num_hidden_layers={layers} is not divisible by mesh.pipeline × parallel.virtual_stages={p * v}; "
            "uneven pipeline stages are not supported"
        )
    if name == "interleaved_1f1b" and m % p:
        errors.append(f"parallel.num_microbatches={m} must be a multiple of mesh.pipeline={p} for interleaved_1f1b")
    if mesh["context"] > 1:
        errors.append(f"mesh.context={mesh['context']}: context parallelism does not combine with mesh.pipeline > 1 yet")
    if hasattr_aux_losses(model):
        errors.append(
            f"model.model_type={model.get('model_type')!r} has auxiliary (router) losses, which the pipeline "
            "engine does not carry yet; set mesh.pipeline=1"
        )
    return errors


def hasattr_aux_losses(model) -> bool:
    from jaxpar.models import MODEL_CLASSES

    cls = MODEL_CLASSES.get(model.get("model_type", "llama"))
    return cls is not None and hasattr(cls, "aux_losses")


def register() -> None:
    preflight.SUPPORTED_AXES.add("pipeline")
    if check_pipeline not in preflight.EXTRA_CHECKS:
        preflight.EXTRA_CHECKS.append(check_pipeline)


register()
