"""The parallel plan: every parallel decision for one config and mesh, made once at setup.

Nothing downstream re-derives a decision from side effects (which rules exist, which arguments
are None): the rules table, the model, the train step and the pipeline engine read this plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.axes import CONTEXT, DATA, MESH_AXES
from jaxpar.parallel.context.plan import ContextPlan, context_plan
from jaxpar.parallel.data import BATCH_AXES, GradientStrategy, gradient_strategy
from jaxpar.parallel.pipeline.options import PipelineOptions, pipeline_options
from jaxpar.parallel.tensor import TensorPlan, tensor_plan
from jaxpar.parallel.zero import ZeroPlan, zero_plan


@dataclass(frozen=True)
class ParallelPlan:
    mesh_shape: tuple = tuple((name, 1) for name in MESH_AXES)  # ((axis, size), ...) in mesh order
    batch_axes: tuple = BATCH_AXES  # mesh axes the batch rows are split over
    grad_accum: int = 1  # microbatches per step outside the pipeline
    gradient: GradientStrategy = GradientStrategy.PLAIN
    zero: ZeroPlan = field(default_factory=ZeroPlan)
    tensor: TensorPlan = field(default_factory=TensorPlan)
    pipeline: PipelineOptions | None = None  # None: mesh.pipeline == 1
    context: ContextPlan | None = None  # None: mesh.context == 1

    def size(self, axis: str) -> int:
        return dict(self.mesh_shape)[axis]

    @property
    def splits_sequence(self) -> bool:
        """Activations split along the sequence somewhere (sequence parallelism or context)."""
        return self.tensor.sequence_parallel or self.context is not None


# A run without a mesh (one device, no sharding): `jaxpar.models.forward`, HF parity tests.
SINGLE_DEVICE = ParallelPlan()


def make_plan(config, mesh: dict, *, has_aux_losses: bool) -> ParallelPlan:
    """From `config` and resolved mesh sizes (`jaxpar.mesh.resolve_mesh_shape`); run preflight first."""
    zero = zero_plan(config.parallel.zero_stage)
    pipeline = pipeline_options(config, mesh)
    grad_accum = config.train.grad_accum
    return ParallelPlan(
        mesh_shape=tuple((name, mesh[name]) for name in MESH_AXES),
        batch_axes=BATCH_AXES,
        grad_accum=grad_accum,
        gradient=gradient_strategy(
            pipelined=pipeline is not None,
            grad_accum=grad_accum,
            data_size=mesh[DATA],
            context_size=mesh[CONTEXT],
            zero_shards_params=zero.shard_params,
            has_aux_losses=has_aux_losses,
        ),
        zero=zero,
        tensor=tensor_plan(config, mesh),
        pipeline=pipeline,
        context=context_plan(config, mesh),
    )
