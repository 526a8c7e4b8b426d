"""Step time, memory and communication of a jaxpar config on given hardware, analytically.

`estimate(config, hardware, num_devices=...)` resolves the config into a `Layout` and returns an
`Estimate`: per-device memory (`jaxpar.analysis.cost.memory`), the planned collectives
(`jaxpar.analysis.cost.comm`), matmul FLOPs per device by part, and with a hardware profile a step time
at achieved rates (`jaxpar.analysis.cost.efficiency`):

  compute  = sum over parts of FLOPs / (peak FLOP/s of the compute dtype x the part's efficiency:
             each matmul by its shape, attention at its kernel's)
  bubble   = compute x f / (1 - f), f = `schedules.bubble_fraction` of the pipeline table
  comm     = sum over collectives of wire bytes / bandwidth of the link its axes cross
             (`hardware.link_bandwidth`: the innermost axes within one node use NVLink / ICI)
  step     = compute + bubble + exposed comm + max(0, overlapped comm - compute) (the collectives
             XLA runs behind compute: `efficiency`, rule 3).
`efficiency=x` instead prices every matmul at x of peak with nothing overlapped (x = 1: the old
peak bound, compute optimistic and communication pessimistic).

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

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.comm import Planned, planned_collectives
from jaxpar.analysis.cost.comm_context import window_hops
from jaxpar.analysis.cost.context_work import attention_fraction, window_fraction
from jaxpar.analysis.cost.efficiency import compute_seconds, overlapped
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.cost.memory import (
    MemoryEstimate,
    estimate_memory,
    moe_matmul_rows_per_token,
    offloaded_bytes_per_step,
    param_counts,
)
from jaxpar.analysis.cost.optimizer_terms import optimizer_terms
from jaxpar.kernels import local_attention


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    comm_by_axes: dict  # axes tuple -> seconds (all collectives)
    bubble_fraction: float
    overlap_by_axes: dict = dataclasses.field(default_factory=dict)  # axes -> seconds XLA can run behind compute
    compute_by_part: dict = dataclasses.field(default_factory=dict)  # part -> seconds
    host: float = 0.0  # activation offload's transfers to host memory and back (copies XLA runs behind compute)

    @property
    def comm(self) -> float:
        return sum(self.comm_by_axes.values())

    @property
    def overlappable(self) -> float:
        return sum(self.overlap_by_axes.values())

    @property
    def exposed_by_axes(self) -> dict:
        """Each axis set's communication less its share of what hides behind compute."""
        share = self.hidden / self.overlappable if self.overlappable else 0.0
        return {a: sec - share * self.overlap_by_axes.get(a, 0.0) for a, sec in self.comm_by_axes.items()}

    @property
    def hidden(self) -> float:
        """Communication seconds that run behind compute."""
        return min(self.overlappable, self.compute)

    @property
    def exposed_comm(self) -> float:
        return self.comm - self.hidden

    @property
    def exposed_host(self) -> float:
        """Offload transfers that compute not already hiding collectives cannot hide."""
        return max(0.0, self.host - (self.compute - self.hidden))

    @property
    def seconds(self) -> float:
        return self.compute + self.bubble + self.exposed_comm + self.exposed_host

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
    def tokens_per_second_per_device(self) -> float | None:
        return None if self.time is None else self.tokens_per_second / self.layout.num_devices

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


def computed_keys(layout: Layout, skip_masked: bool = True) -> float:
    """Keys per query the attention kernels compute, a mean over the layers: the whole sequence times
    the share the kernel skips (`_attention_factor`); a sliding layer on jaxpar_xla's band only the
    band's keys (`jaxpar.kernels.local_attention`). Elsewhere a sliding layer is priced as a full one:
    XLA and cuDNN mask the window. Under context parallelism a sliding layer computes the chunk pairs
    its window leaves (`context_work.window_fraction`)."""
    full = layout.seq * _attention_factor(layout, skip_masked)
    f = layout.facts
    if f.sliding_layers and layout.c > 1 and skip_masked:  # the context kernels skip chunk pairs past the window
        context = layout.plan.context
        sliding = layout.seq * window_fraction(context.impl, layout.seq, layout.c, context.block, context.load_balance,
                                               f.sliding_window, bool(window_hops(layout)))
        return (f.sliding_layers * sliding + (f.layers - f.sliding_layers) * full) / f.layers
    if not f.sliding_layers or not layout.attention_kernel or layout.seq <= 2 * f.sliding_window:
        return full
    tile = -(-f.sliding_window // local_attention.TILES)
    band = (local_attention.TILES + 1) * tile * (-(-layout.seq // tile) * tile / layout.seq)  # padded to whole tiles
    return (f.sliding_layers * min(band, full) + (f.layers - f.sliding_layers) * full) / f.layers


def forward_flops_per_token(layout: Layout, skip_masked: bool = True) -> dict:
    """Matmul FLOPs of one token's forward on one device, by part (layers' parts per layer): the
    model's FLOPs per part (`ModelFacts`) split as the plan shards them. Parts: `qo` (query and
    output projections), `kv`, `latent` (MLA's down-projections), `attention` (the kernel's QK^T
    and PV), `mlp` (dense), `router`, `experts` (the routed rows) and `head`."""
    f, t = layout.facts, layout.t
    tk = t if layout.kv_sharded else 1
    parts = {
        "qo": f.flops_q_o / t,
        # Gathering MLA's latents, every context rank expands every token's keys and values.
        "kv": f.flops_k_v / tk * (layout.c if layout.context_latent else 1),
        # MLA's down-projections: every tensor rank runs them whole, on its own sequence shard under SP.
        "latent": f.flops_latent / (t if layout.sequence_parallel else 1),
        "attention": f.flops_attention_per_key * layout.seq / t * _attention_factor(layout, skip_masked),
        "mlp": f.flops_mlp / t,
        "router": 0.0,
        "experts": 0.0,
        "head": f.flops_head / t,
    }
    if f.sliding_layers:  # (without windows exactly the expression above)
        parts["attention"] = f.flops_attention_per_key * computed_keys(layout, skip_masked) / t
    if layout.is_moe:
        # The router is not split (every device routes all its tokens); the experts' hidden dim is.
        # With dense layers among the MoE layers, a mean over the layers (`MoEFacts.layer_share`).
        rows = moe_matmul_rows_per_token(layout) if layout.target == "cpu" else f.moe.routed_rows(layout.seq)
        parts["router"] = f.flops_router * f.moe.layer_share
        parts["experts"] = rows * f.flops_expert_row / t * f.moe.layer_share
    return parts


LAYER_PARTS = ("qo", "kv", "latent", "attention", "mlp", "router", "experts")


def _recompute(layout: Layout, parts: dict) -> dict:
    """Forward FLOPs per token and layer the backward runs again, by part."""
    out = dict.fromkeys(LAYER_PARTS, 0.0)
    if layout.remat == "full":
        # Remat full re-runs the layer but not the MLP's down projection (its output only feeds the
        # layer output, which the backward does not need): measured on compiled HLO, exact.
        out.update({k: parts[k] for k in LAYER_PARTS})
        out["mlp"] = parts["mlp"] * 2 / 3
    elif layout.remat == "save_dots":
        out["attention"] = parts["attention"]
        if layout.is_moe and layout.target == "cpu":
            # save_dots with XLA:CPU's tiled expert loop re-runs the experts too (their dots sit
            # inside the loop, out of the policy's reach; measured: +25% FLOPs, Mixtral-shaped).
            out["router"], out["experts"] = parts["router"], parts["experts"]
    if layout.c > 1:
        # Context parallelism's blockwise kernel recomputes each score block in its backward:
        # five matmuls there for the forward's two, not four (measured, context 2).
        out["attention"] += parts["attention"] / 2
    if layout.context_latent and layout.remat != "full":
        # The latent gather's checkpoint re-runs the expansion and the attention forward in the backward.
        out["kv"] += parts["kv"]
        out["attention"] += parts["attention"]
    return out


def flops_by_part(layout: Layout, skip_masked: bool = True) -> dict:
    """Matmul FLOPs of the busiest device per step, by part (`forward_flops_per_token`): forward,
    backward at twice the forward, and recomputation. `skip_masked=False`: with context
    parallelism, as if the kernels ran every chunk pair (what compiled HLO counts: both branches
    of each skip cond)."""
    parts = forward_flops_per_token(layout, skip_masked)
    again = _recompute(layout, parts)
    out = dict.fromkeys(parts, 0.0)
    if layout.p > 1:
        # Non-last ranks run each layer forward in F and again in B (stage recompute); the last
        # rank runs them only in B but adds the head. Price the busier.
        layer, recompute = sum(parts[k] for k in LAYER_PARTS), sum(again.values())
        per_layer = layout.layers_per_device
        middle = per_layer * (4 * layer + recompute)
        last = per_layer * (3 * layer + recompute) + 3 * parts["head"]
        forwards = 4 if middle >= last else 3
        for k in LAYER_PARTS:
            out[k] = per_layer * (forwards * parts[k] + again[k])
        out["head"] = 0.0 if middle >= last else 3 * parts["head"]
    else:
        for k in LAYER_PARTS:
            out[k] = layout.layers * (3 * parts[k] + again[k])
        out["head"] = 3 * parts["head"]
    out = {k: v * layout.tokens for k, v in out.items()}
    optimizer = optimizer_terms(layout).flops  # Muon's Newton-Schulz on whole matrices, once per step
    return {**out, "optimizer": float(optimizer)} if optimizer else out


def flops_per_device(layout: Layout, skip_masked: bool = True) -> float:
    """Matmul FLOPs of the busiest device per step (`flops_by_part`, summed)."""
    return sum(flops_by_part(layout, skip_masked).values())


def step_time(layout: Layout, flops: dict, collectives: list[Planned], hardware: hw.Hardware,
              efficiency: float | None = None) -> StepTime:
    """`flops`: `flops_by_part`. `efficiency` None: achieved rates (`jaxpar.analysis.cost.efficiency`);
    a number: every matmul at that fraction of peak, no collective overlapped."""
    if efficiency is None:
        achieved = compute_seconds(layout, flops, hardware)
        compute, by_part = achieved.seconds, achieved.by_part
    else:
        peak = hardware.peak(layout.compute_dtype_name) * efficiency
        by_part = {part: f / peak for part, f in flops.items() if f > 0}
        compute = sum(flops.values()) / peak
    fraction = layout.bubble_fraction
    comm: dict = {}
    overlap: dict = {}
    links: dict = {}  # axes -> bandwidth: a step has dozens of collectives over a few axis sets
    for p in collectives:
        if not p.axes:
            continue
        if p.axes not in links:
            links[p.axes] = hw.link_bandwidth(hardware, layout.mesh, p.axes)
        seconds = p.wire_bytes(layout.mesh) / links[p.axes]
        comm[p.axes] = comm.get(p.axes, 0.0) + seconds
        if efficiency is None and overlapped(p):
            overlap[p.axes] = overlap.get(p.axes, 0.0) + seconds
    host = 2 * offloaded_bytes_per_step(layout) / hardware.host_bandwidth
    return StepTime(compute, compute * fraction / (1 - fraction), comm, fraction, overlap, by_part, host)


def estimate(
    config,
    hardware: hw.Hardware | str | None = None,
    *,
    num_devices: int | None = None,
    mesh: dict | None = None,
    target: str | None = None,
    efficiency: float | None = None,
) -> Estimate:
    """Prices `config` on `num_devices` devices (or a resolved `mesh`). `target`: the XLA
    lowering to price ("gpu", "tpu", "cpu"; default: the hardware's kind, else "gpu").
    `efficiency`: None for achieved rates (`jaxpar.analysis.cost.efficiency`), or the flat fraction of
    peak FLOP/s every matmul reaches, nothing overlapped (1.0: the peak bound)."""
    if isinstance(hardware, str):
        hardware = hw.get(hardware)
    if target is None:
        target = hardware.kind if hardware is not None else "gpu"
    layout = Layout.from_config(config, num_devices, mesh, target=target)
    counts = param_counts(layout)
    collectives = planned_collectives(layout, counts)
    parts = flops_by_part(layout)
    model = layout.facts.model_flops_per_step(layout.global_batch, layout.seq)
    time = step_time(layout, parts, collectives, hardware, efficiency) if hardware is not None else None
    return Estimate(layout, estimate_memory(layout), collectives, sum(parts.values()), model, time, hardware)
