"""Step time, memory and communication of a jaxpar config on given hardware, analytically.

`estimate(config, hardware, num_devices=...)` resolves the config into a `Layout` and returns an
`Estimate`: per-device memory (`jaxpar.analysis.memory`), the planned collectives
(`jaxpar.analysis.comm`), matmul FLOPs per device, and with a hardware profile a step time:

  compute  = FLOPs per device / (peak FLOP/s of the compute dtype x efficiency)
  bubble   = compute x f / (1 - f), f = `schedules.bubble_fraction` of the pipeline table
  comm     = sum over collectives of wire bytes / bandwidth of the link its axes cross
             (`hardware.link_bandwidth`: the innermost axes within one node use NVLink / ICI)
  step     = compute + bubble + comm (no overlap of communication with compute assumed; an
             upper bound; `overlapped_seconds` is the other extreme).

FLOPs are the model's FLOPs per part (`jaxpar.model_facts.ModelFacts`, from its family) split as
the plan shards them, and what XLA computes (checked against every dot of compiled HLO,
`hlo_flops`): matmuls of the projections, MLP / experts and LM head, attention over all S keys
on the XLA path (cuDNN's causal kernel skips half: the plan's attention kernel is cudnn), the
backward at twice the forward, and recomputation: remat full re-runs each layer's forward
(less the MLP's down projection, whose output the backward never needs),
save_dots re-runs attention's batched dots, and a pipeline stage's backward always re-runs its
forward (`jaxpar.parallel.pipeline_stage`). With context parallelism each device attends its
seq / context queries to all S keys, skipping the fully masked chunk pairs
(`context_work.attention_fraction`, about half at long sequences), and the blockwise kernel's
backward recomputes the scores.
"""

from __future__ import annotations

import dataclasses

from jaxpar.analysis import hardware as hw
from jaxpar.analysis.comm import Planned, planned_collectives
from jaxpar.analysis.context_work import attention_fraction
from jaxpar.analysis.layout import Layout
from jaxpar.analysis.memory import MemoryEstimate, estimate_memory, moe_matmul_rows_per_token, param_counts


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    comm_by_axes: dict  # axes tuple -> seconds
    bubble_fraction: float

    @property
    def comm(self) -> float:
        return sum(self.comm_by_axes.values())

    @property
    def seconds(self) -> float:
        return self.compute + self.bubble + self.comm

    @property
    def overlapped_seconds(self) -> float:
        return max(self.compute + self.bubble, self.comm)


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: MemoryEstimate
    collectives: list[Planned]
    flops_per_device: float  # matmul FLOPs one device runs per step (the busiest one)
    model_flops: float  # 6·N·T + causal attention for the whole step (`ModelFacts.model_flops_per_step`), for MFU
    time: StepTime | None
    hardware: hw.Hardware | None

    @property
    def fits(self) -> bool | None:
        return None if self.hardware is None else self.memory.peak <= self.hardware.hbm_bytes

    @property
    def tokens_per_second(self) -> float | None:
        if self.time is None:
            return None
        return self.layout.global_batch * self.layout.seq / self.time.seconds

    @property
    def mfu(self) -> float | None:
        if self.time is None:
            return None
        peak = self.hardware.peak(self.layout.compute_dtype_name) * self.layout.num_devices
        return self.model_flops / (self.time.seconds * peak)

    def wire_bytes_by_axes(self) -> dict:
        out = {}
        for p in self.collectives:
            if p.axes:
                out[p.axes] = out.get(p.axes, 0.0) + p.wire_bytes(self.layout.mesh)
        return out


def _attention_factor(layout: Layout, skip_masked: bool = True) -> float:
    if layout.c > 1:
        if not skip_masked:
            return 1.0
        context = layout.plan.context
        return attention_fraction(context.impl, layout.seq, layout.c, context.block, context.load_balance)
    return 0.5 if layout.flash_attention else 1.0


def forward_flops_per_token(layout: Layout, skip_masked: bool = True) -> dict:
    """Matmul FLOPs of one token's forward on one device, by part (layers per layer): the model's
    FLOPs per part (`ModelFacts`) split as the plan shards them."""
    f, t = layout.facts, layout.t
    tk = t if layout.kv_sharded else 1
    projections = f.flops_q_o / t + f.flops_k_v / tk
    core = f.flops_attention_per_key * layout.seq / t * _attention_factor(layout, skip_masked)
    mlp = f.flops_mlp / t
    if layout.is_moe:
        # The router is not split (every device routes all its tokens); the experts' hidden dim is.
        rows = moe_matmul_rows_per_token(layout) if layout.target == "cpu" else f.moe.routed_rows(layout.seq)
        mlp += f.flops_router + rows * f.flops_expert_row / t
    return {"projections": projections, "attention": core, "mlp": mlp, "head": f.flops_head / t}


def flops_per_device(layout: Layout, skip_masked: bool = True) -> float:
    """Matmul FLOPs of the busiest device per step. `skip_masked=False`: with context
    parallelism, as if the kernels ran every chunk pair (what compiled HLO counts: both branches
    of each skip cond)."""
    parts = forward_flops_per_token(layout, skip_masked)
    layer = parts["projections"] + parts["attention"] + parts["mlp"]
    # Remat full re-runs the layer but not the MLP's down projection (its output only feeds the
    # layer output, which the backward does not need): measured on compiled HLO, exact.
    down = parts["mlp"] / 3 if not layout.is_moe else 0.0
    # save_dots with XLA:CPU's tiled expert loop re-runs the experts too (their dots sit inside
    # the loop, out of the policy's reach; measured: +25% FLOPs, Mixtral-shaped).
    tiled = layout.is_moe and layout.target == "cpu"
    saved_dots = parts["attention"] + (parts["mlp"] if tiled else 0.0)
    recompute = {"none": 0.0, "full": layer - down, "save_dots": saved_dots}[layout.remat]
    if layout.c > 1:
        # Context parallelism's blockwise kernel recomputes each score block in its backward:
        # five matmuls there for the forward's two, not four (measured, context 2).
        recompute += parts["attention"] / 2
    if layout.p > 1:
        # Non-last ranks run each layer forward in F and again in B (stage recompute); the
        # last rank runs them only in B but adds the head. Price the busier.
        per_layer = 2 * layer + 2 * layer + recompute
        middle = per_layer
        last = (layer + 2 * layer + recompute) + 3 * parts["head"] / layout.layers_per_device
        per_token = layout.layers_per_device * max(middle, last)
    else:
        per_token = layout.layers * (3 * layer + recompute) + 3 * parts["head"]
    return per_token * layout.tokens


def step_time(layout: Layout, flops: float, collectives: list[Planned], hardware: hw.Hardware, efficiency: float) -> StepTime:
    compute = flops / (hardware.peak(layout.compute_dtype_name) * efficiency)
    fraction = layout.bubble_fraction
    comm: dict = {}
    for p in collectives:
        if not p.axes:
            continue
        seconds = p.wire_bytes(layout.mesh) / hw.link_bandwidth(hardware, layout.mesh, p.axes)
        comm[p.axes] = comm.get(p.axes, 0.0) + seconds
    return StepTime(compute, compute * fraction / (1 - fraction), comm, fraction)


def estimate(
    config,
    hardware: hw.Hardware | str | None = None,
    *,
    num_devices: int | None = None,
    mesh: dict | None = None,
    target: str | None = None,
    efficiency: float = 1.0,
) -> Estimate:
    """Prices `config` on `num_devices` devices (or a resolved `mesh`). `target`: the XLA
    lowering to price ("gpu", "tpu", "cpu"; default: the hardware's kind, else "gpu").
    `efficiency`: the fraction of peak FLOP/s the matmuls reach (1.0: the peak bound)."""
    if isinstance(hardware, str):
        hardware = hw.get(hardware)
    if target is None:
        target = hardware.kind if hardware is not None else "gpu"
    layout = Layout.from_config(config, num_devices, mesh, target=target)
    counts = param_counts(layout)
    collectives = planned_collectives(layout, counts)
    flops = flops_per_device(layout)
    model = layout.facts.model_flops_per_step(layout.global_batch, layout.seq)
    time = step_time(layout, flops, collectives, hardware, efficiency) if hardware is not None else None
    return Estimate(layout, estimate_memory(layout), collectives, flops, model, time, hardware)
