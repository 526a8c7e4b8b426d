"""The parallel plan: every execution decision for one config, model and mesh, made once at setup.

Nothing downstream re-derives a decision from side effects (which rules exist, which arguments
are None, which backend it runs on): the rules table, the model, the train step, the pipeline
engine and the cost model (`jaxpar.analysis`, which prices the plan the run would execute) read
this plan. `make_plan` takes the model's facts (`jaxpar.model_facts.ModelFacts`, from its family)
and the backend the program is compiled for, so the planner can build the plan a GPU run would
execute on a machine without one. tests/test_structure.py checks that every field is read by the
cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from jaxpar.axes import CONTEXT, DATA, EXPERT, MESH_AXES
from jaxpar.parallel.context.plan import ContextPlan, context_plan
from jaxpar.parallel.data import BATCH_AXES, GradientStrategy, gradient_strategy
from jaxpar.parallel.pipeline.options import PipelineOptions, pipeline_options
from jaxpar.parallel.tensor import TensorPlan, tensor_plan
from jaxpar.parallel.zero import ZeroPlan, resolve_axes, zero_plan

# `parallel.remat` names (the policies themselves: `jaxpar.models.decoder.REMAT_POLICIES`).
REMAT_NAMES = ("none", "full", "save_dots", "offload")
# `parallel.remat="auto"` per backend: the fastest policy measured there. XLA:CPU, fp32, 2 cores:
# the bench config on one device, none 940 / full 1093 / save_dots 1078 tokens/s (issue 11's
# machine); MaxText's tiny Llama on 8 emulated devices, none 5.3-5.8k / full 7.4-7.9k. Saving every
# layer's residuals through the layer scan costs XLA:CPU more than recomputing them. (On a slower
# 2-core host on 2026-11-29 the one-device bench tied: none 782, full 764, save_dots 779.)
# Elsewhere scripts/train.py resolves "auto" first, by the cost model (`jaxpar.analysis.planner.remat`:
# the fastest policy that fits); a program that builds a run itself gets no recompute.
AUTO_REMAT = {"cpu": "full"}
# xla: jax.nn.dot_product_attention's XLA path; cudnn: its cuDNN path; jaxpar_xla:
# `jaxpar.kernels.attention` (plain XLA, hand-written backward).
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "jaxpar_xla")
HALF_PRECISION = ("bfloat16", "float16")


def resolve_remat(name: str, backend: str) -> str:
    return AUTO_REMAT.get(backend, "none") if name == "auto" else name


def resolve_attention(name: str, compute_dtype: str, backend: str) -> str:
    """`parallel.attention_impl`: "auto" is cuDNN on GPU for 16-bit compute, jaxpar's own XLA
    kernel on CPU (bench config, one device, fp32: attention forward + backward 1.8× faster than
    jax's XLA path), jax's XLA path otherwise."""
    if name != "auto":
        return name
    if backend == "gpu" and compute_dtype in HALF_PRECISION:
        return "cudnn"
    return "jaxpar_xla" if backend == "cpu" else "xla"


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
    remat: str = "none"  # a name of REMAT_NAMES (resolved for the backend, never "auto")
    attention: str = "xla"  # the attention kernel: "xla", "cudnn" or "jaxpar_xla" (resolved)
    # Rows of each device's MoE batch dispatched as this many independent chunks (`parallel.expert_overlap`:
    # 2 with expert parallelism, else 1), so one chunk's all-to-all can run beside another's experts.
    expert_chunks: int = 1

    def size(self, axis: str) -> int:
        return dict(self.mesh_shape)[axis]

    @property
    def microbatches(self) -> int:
        """Microbatches per step: the pipeline's, else gradient accumulation's."""
        return self.pipeline.microbatches if self.pipeline is not None else self.grad_accum

    @property
    def splits_sequence(self) -> bool:
        """Activations split along the sequence somewhere (sequence parallelism or context)."""
        return self.tensor.sequence_parallel or self.context is not None


# A run without a mesh (one device, no sharding): `jaxpar.models.forward`, HF parity tests.
SINGLE_DEVICE = ParallelPlan()


def make_plan(config, mesh: dict, facts, backend: str | None = None) -> ParallelPlan:
    """From `config`, resolved mesh sizes (`jaxpar.mesh.resolve_mesh_shape`), the model's facts and
    the backend compiled for (default: jax's); run preflight first."""
    backend = backend or jax.default_backend()
    zero = zero_plan(config.parallel.zero_stage, resolve_axes(config.parallel.zero_axes, config.parallel.zero_stage, mesh))
    pipeline = pipeline_options(config, mesh, facts)
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
            has_aux_losses=facts.is_moe,
        ),
        zero=zero,
        tensor=tensor_plan(config, mesh),
        pipeline=pipeline,
        context=context_plan(config, mesh, facts),
        remat=resolve_remat(config.parallel.remat, backend),
        attention=resolve_attention(config.parallel.attention_impl, config.train.compute_dtype, backend),
        expert_chunks=2 if config.parallel.expert_overlap and mesh[EXPERT] > 1 else 1,
    )
