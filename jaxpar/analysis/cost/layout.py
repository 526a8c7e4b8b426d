"""What the cost model prices: the plan the run would execute, the model's facts, the batch.

`Layout.from_config(config, num_devices | mesh, target)` resolves the mesh, asks the family for the
model's facts (`jaxpar.model_facts.ModelFacts`) and builds the `ParallelPlan` with
`jaxpar.parallel.plan.make_plan` — the same call `jaxpar.train.setup.build` makes — for the backend
`target` compiles for. Every parallel decision the analysis prices (ZeRO, gradient strategy,
microbatches, KV replication, pipeline and context options, remat, the attention kernel) is read
from that plan, never re-derived; every model size from the facts. The properties below are
shorthands for those reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

from jaxpar import fp8
from jaxpar.axes import CONTEXT, DATA, EXPERT, MESH_AXES, PIPELINE, TENSOR
from jaxpar.dtypes import DTYPE_BYTES
from jaxpar.mesh import resolve_mesh_shape
from jaxpar.model_facts import ModelFacts
from jaxpar.models import lora
from jaxpar.models.families import facts as model_facts
from jaxpar.parallel.data import GradientStrategy
from jaxpar.parallel.pipeline.schedules import ScheduleKind, bubble_fraction, schedule_kind
from jaxpar.parallel.pipeline.slots import slot_plan_for
from jaxpar.parallel.plan import ParallelPlan, make_plan
from jaxpar.parallel.zero import ZeroPlan

# What the program is compiled for. "gpu" / "tpu": the lowering jaxpar uses there (ragged_dot
# experts, native 16-bit activations, reduce-scatter for partitioner-made reductions). "cpu": the
# emulated devices this project tests on, whose lowering differs in ways the model prices
# (`jaxpar.analysis.cost.comm.XLA_CPU`, the tiled grouped matmul, fp32 activation buffers).
TARGETS = ("gpu", "tpu", "cpu")


class LayoutError(ValueError):
    """A config the cost model cannot price (one line, naming the key)."""


def _model_json(config) -> str:
    # With train.lora, the adapted model: its adapters are parameters, and the only trained ones.
    # With delayed FP8 scaling, its amax histories (model state, held like parameters).
    train = config.train
    model = lora.adapted(config.model, train.lora) if "lora" in train else config.model
    return fp8.with_state(model, train).to_json()


def _model_inputs(config) -> tuple:
    """What `_model_json` reads: the model and train.lora sections (by identity), the FP8 keys."""
    train = config.train
    return config.model, train.get("lora"), train.get("fp8"), train.get("fp8_amax_history")


class _Shared:
    """The model's facts and JSON of one config, for the configs that share its model and
    train.lora sections (the same objects) and FP8 keys: the planner's candidates
    (`planner.candidates`); and the train section's JSON per set of changed train leaves."""

    def __init__(self, config):
        self.config, self.inputs = config, _model_inputs(config)
        self.train_fields = config.train._fields
        self.train_jsons: dict = {}

    @functools.cached_property
    def model_json(self) -> str:
        return _model_json(self.config)

    @functools.cached_property
    def facts(self) -> ModelFacts:
        return model_facts(self.config.model)

    def holds(self, config) -> bool:
        inputs = _model_inputs(config)
        return all(a is b for a, b in zip(inputs[:2], self.inputs[:2])) and inputs[2:] == self.inputs[2:]

    def train_json(self, train) -> str:
        """`train.to_json()`, once per set of leaves that differ from the shared train section's
        (by identity; the others are the same objects, so the same JSON)."""
        fields = train._fields
        if fields.keys() != self.train_fields.keys() or type(train) is not type(self.config.train):
            return train.to_json()
        changed = tuple((k, v) for k, v in fields.items() if v is not self.train_fields[k])
        if not all(type(v) in (int, float, str, bool) for _, v in changed):
            return train.to_json()
        key = tuple((k, type(v), v) for k, v in changed)
        if key not in self.train_jsons:
            self.train_jsons[key] = train.to_json()
        return self.train_jsons[key]


_SHARED: contextvars.ContextVar = contextvars.ContextVar("shared_model", default=None)


@contextlib.contextmanager
def shared_model(config):
    """Within it, layouts of configs sharing `config`'s model section (not copies of it) take its
    facts and JSON computed once, and train sections sharing `config.train`'s leaves their JSON: the
    planner prices thousands of candidates of one model, and `ConfigDict.to_json` and the family's
    facts per candidate were 15% of the search. Nothing may change these sections meanwhile
    (identity stands for equality only while the planner holds them unchanged)."""
    token = _SHARED.set(_Shared(config))
    try:
        yield
    finally:
        _SHARED.reset(token)


@dataclasses.dataclass(frozen=True)
class Layout:
    config: object  # the ConfigDict it came from (param trees are read from config.model)
    plan: ParallelPlan  # what the run executes (`make_plan` for `target`)
    facts: ModelFacts  # the model, from its family
    global_batch: int
    seq: int
    compute_bytes: int
    param_bytes: int
    target: str = "gpu"

    @classmethod
    def from_config(
        cls, config, num_devices: int | None = None, mesh: dict | None = None, target: str = "gpu"
    ) -> Layout:
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
        train = config.train
        for key in ("compute_dtype", "param_dtype"):
            if train[key] not in DTYPE_BYTES:
                raise LayoutError(f"train.{key}={train[key]!r} is not one of {tuple(DTYPE_BYTES)}")
        shared = _SHARED.get()
        facts = shared.facts if shared is not None and config.model is shared.config.model else model_facts(config.model)
        return cls(
            config=config,
            plan=make_plan(config, mesh, facts, backend=target),
            facts=facts,
            global_batch=train.global_batch_size,
            seq=train.seq_len,
            compute_bytes=DTYPE_BYTES[train.compute_dtype],
            param_bytes=DTYPE_BYTES[train.param_dtype],
            target=target,
        )

    # The model and train sections as JSON, once per layout: the keys per-model terms are cached
    # under (`memory.param_counts`, `optimizer_terms`; ConfigDict.to_json was 8% of the planner).
    @functools.cached_property
    def model_json(self) -> str:
        shared = _SHARED.get()
        if shared is not None and shared.holds(self.config):
            return shared.model_json
        return _model_json(self.config)

    @functools.cached_property
    def train_json(self) -> str:
        shared = _SHARED.get()
        return shared.train_json(self.config.train) if shared is not None else self.config.train.to_json()

    def once(self, fn):
        """`fn(self)`, computed once per layout: for terms several parts of the model read
        (`memory.param_counts` twice, `optimizer_terms` four times per estimate)."""
        memo = self.__dict__.setdefault("_once", {})  # beside the cached properties
        if fn not in memo:
            memo[fn] = fn(self)
        return memo[fn]

    # --- mesh shorthands ---
    @functools.cached_property
    def mesh(self) -> dict:
        return dict(self.plan.mesh_shape)

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

    # --- model shorthands (the facts) ---
    @property
    def layers(self) -> int:
        return self.facts.layers

    @property
    def hidden(self) -> int:
        return self.facts.hidden

    @property
    def heads(self) -> int:
        return self.facts.heads

    @property
    def kv_heads(self) -> int:
        return self.facts.kv_heads

    @property
    def head_dim(self) -> int:
        return self.facts.head_dim

    @property
    def vocab(self) -> int:
        """Padded, as stored."""
        return self.facts.vocab

    @property
    def ffn(self) -> int:
        """The dense MLP's hidden size (0 for a routed layer)."""
        return self.facts.ffn

    @property
    def is_moe(self) -> bool:
        return self.facts.is_moe

    @property
    def experts(self) -> int:
        return self.facts.moe.experts if self.is_moe else 0

    @property
    def top_k(self) -> int:
        return self.facts.moe.top_k if self.is_moe else 0

    @property
    def capacity_factor(self) -> float:
        return self.facts.moe.capacity_factor if self.is_moe else 0.0

    @property
    def expert_ffn(self) -> int:
        return self.facts.moe.expert_ffn if self.is_moe else 0

    # --- plan shorthands (decisions, read) ---
    @property
    def zero(self) -> ZeroPlan:
        return self.plan.zero

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes (size > 1) the batch rows are split over."""
        return tuple(a for a in self.plan.batch_axes if self.mesh[a] > 1)

    @property
    def grad_accum(self) -> int:
        return self.plan.grad_accum

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches (p > 1), else gradient accumulation steps."""
        return self.plan.microbatches

    @property
    def gradient(self) -> GradientStrategy:
        return self.plan.gradient

    @property
    def remat(self) -> str:
        """What the backward recomputes: offload recomputes what save_dots does (it saves the same names)."""
        return "save_dots" if self.plan.remat == "offload" else self.plan.remat

    @property
    def offloads(self) -> bool:
        """remat offload: the saved projection outputs live in host memory between forward and backward."""
        return self.plan.remat == "offload"

    @property
    def sequence_parallel(self) -> bool:
        return self.plan.tensor.sequence_parallel

    @property
    def kv_sharded(self) -> bool:
        return self.plan.tensor.kv_heads_sharded

    @property
    def local_kv_heads(self) -> int:
        """KV heads of one tensor rank's attention: its share of them, or the one repeated head it
        needs when they are fewer than tensor (`TensorPlan.kv_repeat`)."""
        return self.kv_heads * self.plan.tensor.kv_repeat // self.t

    @property
    def virtual_stages(self) -> int:
        return self.plan.pipeline.virtual_stages if self.plan.pipeline is not None else 1

    @property
    def relays_layers(self) -> bool:
        """The engine re-lays the layer stack into stage order every step: v > 1 (interleaved or a
        V shape) on storage in the natural order (`PipelineOptions.layers_in_schedule_order`
        off; the plan sets it for every such layout whose stacks are split over `pipeline`,
        `options.stores_in_schedule_order`). Stored in the schedule's order, an equal split moves
        no layers (measured on config-built runs, tests/parallel/pipeline/test_pipeline_layer_order.py)."""
        pipe = self.plan.pipeline
        return pipe is not None and self.p > 1 and pipe.virtual_stages > 1 and not pipe.layers_in_schedule_order

    @property
    def vocab_spread(self) -> bool:
        """The embedding and LM head split by vocab over pipeline x tensor (`pipeline/vocab.py`)."""
        return self.plan.pipeline is not None and self.plan.pipeline.vocab == "spread"

    @property
    def context_impl(self) -> str | None:
        return self.plan.context.impl if self.plan.context is not None else None

    @property
    def context_latent(self) -> bool:
        """all_gather moves the latents keys and values are expanded from (`parallel.context.latent`)."""
        return self.plan.context is not None and self.plan.context.latent

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
    def vocab_shards(self) -> int:
        """Devices one vocab table is split over: tensor, and pipeline with "spread"."""
        return self.t * (self.p if self.vocab_spread else 1)

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
        """The plan's kernel is cuDNN's fused attention: no [S, S] scores are materialised or saved,
        and the causal kernel skips the masked half (with context parallelism the context kernels
        run instead; with sinks or soft-capping the XLA path)."""
        return self.plan.attention == "cudnn" and self.plan.context is None and self.facts.cudnn_attention

    @property
    def attention_kernel(self) -> bool:
        """The plan's kernel is jaxpar's XLA attention (`kernels/attention.py`, no context split): it
        materialises [S, S] scores but saves only q, k, v, the output and the log-sum-exp, and
        recomputes the probabilities in its backward."""
        return self.plan.attention == "jaxpar_xla" and self.plan.context is None

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
    def pipeline_shape(self) -> PipelineShape:
        """Time steps, bubble and buffer slots of the pipeline schedule (p > 1)."""
        pipe = self.plan.pipeline
        return pipeline_shape(pipe.schedule, self.p, pipe.microbatches, pipe.virtual_stages)

    @property
    def bubble_fraction(self) -> float:
        return self.pipeline_shape.bubble_fraction if self.p > 1 else 0.0

    def describe(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        spans = self.zero.stage and self.c > 1 and CONTEXT in self.zero.axes
        extra = [f"zero{self.zero.stage}" + ("@dxc" if spans else "") if self.zero.stage else "", "sp" if self.sequence_parallel else ""]
        if self.c > 1:
            extra.append(f"cp={self.context_impl}" + ("(latent)" if self.context_latent else ""))
        extra.append(f"remat={self.remat}")
        if self.p > 1:
            pipe = self.plan.pipeline
            extra.append(f"{pipe.schedule.name} m={pipe.microbatches}" + (f" v={pipe.virtual_stages}" if pipe.virtual_stages > 1 else ""))
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


# Cached apart from `_pipeline_shape`: every m > 4p of one (kind, p, v) extrapolates from the same
# two tables, and their bubble fraction was recounted each time (70B on 8 -> 32 A100s: 238 calls, 50 tables).
@functools.lru_cache(maxsize=256)
def _exact_shape(kind: ScheduleKind | str, p: int, m: int, v: int) -> PipelineShape:
    slots = slot_plan_for(schedule_kind(kind), p, m, v)
    return PipelineShape(slots.schedule.num_steps, bubble_fraction(slots.schedule), slots.act_slots, slots.grad_slots)


def pipeline_shape(kind: ScheduleKind | str, p: int, m: int, v: int) -> PipelineShape:
    """The shape of the table of schedule `kind` (a record, `schedules.ScheduleKind`, or its name)
    for p ranks, m microbatches, v virtual stages."""
    return _pipeline_shape(schedule_kind(kind), p, m, v)


@functools.lru_cache(maxsize=1024)
def _pipeline_shape(kind: ScheduleKind, p: int, m: int, v: int) -> PipelineShape:
    """Exact from the tables up to m = 4p. Beyond, extrapolated from m = 2p and 4p: in every
    schedule the idle time is fixed once m >= 2p and the time steps and buffer slots grow
    linearly in m (slots are constant except GPipe's, which stash every microbatch) — checked
    against the exact tables by tests/analysis/test_planner.py. Building a table and its slot plan for
    m = 512 takes ~0.3 s; the planner prices hundreds of such layouts."""
    if m <= 4 * p:
        return _exact_shape(kind, p, m, v)
    lo, hi = _exact_shape(kind, p, 2 * p, v), _exact_shape(kind, p, 4 * p, v)

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
