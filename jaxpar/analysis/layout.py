"""A jaxpar config resolved into the numbers the cost model needs: model dims, mesh, parallel knobs."""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.axes import CONTEXT, DATA, EXPERT, MESH_AXES, PIPELINE, TENSOR
from jaxpar.mesh import resolve_mesh_shape
from jaxpar.config import head_dim_of, padded_vocab_size
from jaxpar.models.options import resolve_remat
from jaxpar.parallel.data import GradientStrategy, gradient_strategy
from jaxpar.parallel.pipeline.schedules import bubble_fraction, make_schedule
from jaxpar.parallel.pipeline.slots import slot_plan_for


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# What the program is compiled for. "gpu" / "tpu": the lowering jaxpar uses there (ragged_dot
# experts, native 16-bit activations, reduce-scatter for partitioner-made reductions). "cpu": the
# emulated devices this project tests on, whose lowering differs in ways the model prices
# (`jaxpar.analysis.comm.XLA_CPU`, the tiled grouped matmul, fp32 activation buffers).
TARGETS = ("gpu", "tpu", "cpu")


class LayoutError(ValueError):
    """A config the cost model cannot price (one line, naming the key)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    config: object  # the ConfigDict it came from (models.param_shapes needs config.model)
    mesh: dict  # axis name -> size, resolved
    # model
    model_type: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # padded, as stored
    experts: int  # 0 for dense
    top_k: int
    capacity_factor: float
    # batch
    global_batch: int
    seq: int
    grad_accum: int
    # parallel
    zero_stage: int
    remat: str
    sequence_parallel: bool
    schedule: str
    microbatches: int  # pipeline microbatches (p > 1), else grad_accum
    virtual_stages: int
    compute_bytes: int
    param_bytes: int
    target: str = "gpu"
    pipeline_vocab: str = "spread"  # p > 1: embedding / head split over pipeline ("spread") or on the end stages ("ends")
    context_impl: str = "all_gather"  # c > 1: parallel.context_impl
    context_load_balance: bool = True
    context_block: int = 512  # parallel.context_block_size

    @classmethod
    def from_config(
        cls, config, num_devices: int | None = None, mesh: dict | None = None, target: str = "gpu"
    ) -> "Layout":
        """`mesh`: resolved axis sizes; else `config.mesh` resolved for `num_devices` devices."""
        if target not in TARGETS:
            raise LayoutError(f"target={target!r} is not one of {TARGETS}")
        if mesh is None:
            if num_devices is None:
                sizes = {name: int(config.mesh[name]) for name in MESH_AXES}
                if any(s == -1 for s in sizes.values()):
                    raise LayoutError("mesh: an axis is -1; pass num_devices (or a resolved mesh) to price it")
                num_devices = math.prod(sizes.values())
            mesh = resolve_mesh_shape(config.mesh, num_devices)
        mesh = {name: int(mesh.get(name, 1)) for name in MESH_AXES}
        model, train, parallel = config.model, config.train, config.parallel
        for key in ("compute_dtype", "param_dtype"):
            if train[key] not in _DTYPE_BYTES:
                raise LayoutError(f"train.{key}={train[key]!r} is not one of {tuple(_DTYPE_BYTES)}")
        moe = model.model_type == "mixtral"
        p = mesh[PIPELINE]
        return cls(
            config=config,
            mesh=mesh,
            model_type=model.model_type,
            layers=model.num_hidden_layers,
            hidden=model.hidden_size,
            ffn=model.intermediate_size,
            heads=model.num_attention_heads,
            kv_heads=model.num_key_value_heads,
            head_dim=head_dim_of(model),
            vocab=padded_vocab_size(model.vocab_size),
            experts=model.num_local_experts if moe else 0,
            top_k=model.num_experts_per_tok if moe else 0,
            capacity_factor=float(model.capacity_factor) if moe else 0.0,
            global_batch=train.global_batch_size,
            seq=train.seq_len,
            grad_accum=train.grad_accum,
            zero_stage=parallel.zero_stage,
            remat=resolve_remat(parallel.remat),  # "auto": what this backend's run would use
            sequence_parallel=bool(parallel.sequence_parallel),
            schedule=parallel.pipeline_schedule,
            microbatches=(parallel.num_microbatches or p) if p > 1 else train.grad_accum,
            virtual_stages=parallel.virtual_stages if p > 1 else 1,
            compute_bytes=_DTYPE_BYTES[train.compute_dtype],
            param_bytes=_DTYPE_BYTES[train.param_dtype],
            target=target,
            pipeline_vocab=parallel.pipeline_vocab,
            context_impl=parallel.context_impl,
            context_load_balance=bool(parallel.context_load_balance),
            context_block=int(parallel.context_block_size),
        )

    # --- mesh shorthands ---
    @property
    def d(self) -> int:
        return self.mesh[DATA]

    @property
    def p(self) -> int:
        return self.mesh[PIPELINE]

    @property
    def c(self) -> int:
        return self.mesh[CONTEXT]

    @property
    def e(self) -> int:
        return self.mesh[EXPERT]

    @property
    def t(self) -> int:
        return self.mesh[TENSOR]

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes (size > 1) the batch rows are split over: data and expert."""
        return tuple(a for a in (DATA, EXPERT) if self.mesh[a] > 1)

    @property
    def replicas(self) -> int:
        return self.d * self.e

    @property
    def rows(self) -> int:
        """Batch rows one device holds per step (all microbatches together)."""
        return self.global_batch // self.replicas

    @property
    def tokens(self) -> int:
        """Tokens one device processes per step, before any tensor / sequence-parallel split (with
        context parallelism each device holds seq / context tokens of every row)."""
        return self.rows * self.seq // self.c

    @property
    def vocab_spread(self) -> bool:
        """The embedding and LM head split by vocab over pipeline x tensor (`pipeline/vocab.py`)."""
        return self.p > 1 and self.pipeline_vocab == "spread"

    @property
    def vocab_shards(self) -> int:
        """Devices one vocab table is split over: tensor, and pipeline with "spread"."""
        return self.t * (self.p if self.vocab_spread else 1)

    @property
    def kv_sharded(self) -> bool:
        return self.kv_heads % self.t == 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def gradient(self) -> GradientStrategy:
        """The train step's gradient path, by the plan's own rule (`parallel.data.gradient_strategy`;
        MoE models carry auxiliary losses)."""
        return gradient_strategy(
            pipelined=self.p > 1, grad_accum=self.grad_accum, data_size=self.d, context_size=self.c,
            zero_shards_params=self.zero_stage >= 3, has_aux_losses=self.is_moe,
        )

    @property
    def layers_per_device(self) -> int:
        return self.layers // self.p

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of compute-dtype values in buffers and collectives. XLA:CPU keeps
        16-bit values in fp32 (measured, bf16 compute: the data=8 stash matched the fp32 count, and
        every 16-bit collective — TP all-reduces, ZeRO-3 gathers, EP all-to-alls, PP permutes —
        moved exactly twice the bf16 bytes)."""
        return 4 if self.target == "cpu" else self.compute_bytes

    @property
    def flash_attention(self) -> bool:
        """cuDNN's fused attention (GPU, 16-bit compute, attention_impl auto / cudnn): no [S, S]
        scores are materialised or saved, and the causal kernel skips the masked half."""
        impl = self.config.parallel.attention_impl
        return self.target == "gpu" and self.compute_bytes == 2 and impl in ("auto", "cudnn") and self.c == 1

    @property
    def attention_kernel(self) -> bool:
        """jaxpar's CPU attention (`kernels/attention.py`, attention_impl auto / jaxpar_xla on CPU,
        no context split): it materialises [S, S] scores but saves only q, k, v, the output and
        the log-sum-exp, and recomputes the probabilities in its backward."""
        impl = self.config.parallel.attention_impl
        return self.target == "cpu" and impl in ("auto", "jaxpar_xla") and self.c == 1

    @property
    def saves_scores(self) -> bool:
        """Attention materialises [S, S] scores and saves them for the backward: not with cuDNN's
        fused kernel, nor with context parallelism's blockwise kernels (`parallel/context/local.py`:
        a custom VJP that saves q, k, v, the output and the log-sum-exp, and recomputes score
        blocks of at most [block_q, block_kv] in the backward)."""
        return not self.flash_attention and self.c == 1

    @property
    def compute_dtype_name(self) -> str:
        return self.config.train.compute_dtype

    @property
    def pipeline_shape(self) -> "PipelineShape":
        """Time steps, bubble and buffer slots of the pipeline schedule (p > 1)."""
        return pipeline_shape(self.schedule, self.p, self.microbatches, self.virtual_stages)

    @property
    def bubble_fraction(self) -> float:
        return self.pipeline_shape.bubble_fraction if self.p > 1 else 0.0

    def describe(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        extra = [f"zero{self.zero_stage}" if self.zero_stage else "", "sp" if self.sequence_parallel else ""]
        if self.c > 1:
            extra.append(f"cp={self.context_impl}")
        extra.append(f"remat={self.remat}")
        if self.p > 1:
            extra.append(f"{self.schedule} m={self.microbatches}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        elif self.grad_accum > 1:
            extra.append(f"accum={self.grad_accum}")
        return " ".join([mesh] + [x for x in extra if x])



@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """What the cost model needs of a schedule table: its time steps (each moves one activation
    and one gradient between neighbours), its idle fraction (`schedules.bubble_fraction`) and the
    activation / gradient buffer slots of the engine's carry (`pipeline.slots`)."""

    num_steps: float
    bubble_fraction: float
    act_slots: float
    grad_slots: float


def _exact_shape(name: str, p: int, m: int, v: int) -> PipelineShape:
    schedule = make_schedule(name, p, m, v)
    slots = slot_plan_for(name, p, m, v)
    return PipelineShape(schedule.num_steps, bubble_fraction(schedule), slots.act_slots, slots.grad_slots)


@functools.lru_cache(maxsize=1024)
def pipeline_shape(name: str, p: int, m: int, v: int) -> PipelineShape:
    """Exact from the tables up to m = 4p. Beyond, extrapolated from m = 2p and 4p: in every
    schedule the idle time is fixed once m >= 2p and the time steps and buffer slots grow
    linearly in m (slots are constant except GPipe's, which stash every microbatch) — checked
    against the exact tables by tests/test_planner.py. Building a table and its slot plan for
    m = 512 takes ~0.3 s; the planner prices hundreds of such layouts."""
    if m <= 4 * p:
        return _exact_shape(name, p, m, v)
    lo, hi = _exact_shape(name, p, 2 * p, v), _exact_shape(name, p, 4 * p, v)

    def line(a, b):
        return a + (b - a) * (m - 2 * p) / (2 * p)

    # Work per rank is proportional to m; the idle time of the lower table stays.
    work_lo = 1.0 - lo.bubble_fraction
    idle = lo.bubble_fraction
    work = work_lo * m / (2 * p)
    return PipelineShape(
        num_steps=line(lo.num_steps, hi.num_steps),
        bubble_fraction=idle / (idle + work),
        act_slots=line(lo.act_slots, hi.act_slots),
        grad_slots=line(lo.grad_slots, hi.grad_slots),
    )
