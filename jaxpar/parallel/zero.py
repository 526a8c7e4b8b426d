"""ZeRO over `data` (and `context`): stage 1 shards optimizer state, stage 3 (FSDP) also shards parameters.

What it shards: every parameter dim with logical name `embed` is split over the plan's ZeRO axes
(`ZeroPlan.axes`) — in the optimizer state (Adam moments) from stage 1, in the parameters too at
stage 3. Norm scales are never split (too small to matter). The rules table (`jaxpar.sharding`)
reads `ZeroPlan` to place the axes there.

Which axes (`parallel.zero_axes`): `data`, or `data+context` — with context parallelism every
parameter's gradient is a sum over data x context anyway (each context rank holds a slice of every
sequence), so, as Megatron's distributed optimizer does over its DP x CP group, the state can be
split over both: c times less optimizer state (and, at stage 3, parameters) per device. "auto" (the
default) takes data x context whenever mesh.context > 1, except ZeRO-3 with a pipeline (the engine
is manual over `context` and runs whole layers per context rank: data only).
Why it is the default: it frees memory at no cost in step time. The gradients cross data x context
either way, so the traffic barely changes — ZeRO-1's gradient reduce-scatter and parameter
all-gather span d·c devices instead of d, moving (dc-1)/dc instead of (d-1)/d of their bytes (with
per-rank accumulation the one all-reduce over d·c becomes a reduce-scatter, half of it), ZeRO-3's
per-layer gathers likewise, behind compute. Priced on Llama 3 70B at 32k and 128k tokens on 64 and
128 H100 (tensor 8 x context 2-8 x data 2-4, ZeRO-1 and 3, remat full), the step time moves by under
0.05% while the peak per device falls by 4-65 GiB (docs/experiments.md, section 8 measures it
compiled): room for less recomputation and fewer microbatches, which is where the speed comes from.
The planner tries both (`jaxpar.analysis.planner.candidates`).

Collectives: stage 1 — the gradient reduction becomes a reduce-scatter to the optimizer-state
layout (`constrain_grads`), and the updated parameters are all-gathered back to their replicated
layout. Stage 3 — each layer's parameters are all-gathered inside the layer scan just before use
(`gather_layer`; again in the backward, whatever the remat policy: `layer_remat_policy`), one
layer at a time, and gradients are reduce-scattered per microbatch, as FSDP does.

Proven equal to one device by `tests/parallel/test_degeneracy.py` (zero1, zero3, zero3 + tensor + SP, and
over data x context with and without accumulation); the memory division by
`tests/analysis/test_compiled.py::test_zero_stages_divide_memory_over_data`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxpar.axes import CONTEXT, DATA, PIPELINE

STAGES = (0, 1, 3)
# The mesh axis ZeRO always shards over (`parallel.zero_axes` may add `context`).
ZERO_AXIS = DATA
# `parallel.zero_axes` values: "auto", or the mesh axes joined by "+".
AXES_CHOICES = ("auto", DATA, f"{DATA}+{CONTEXT}")


@dataclass(frozen=True)
class ZeroPlan:
    shard_optimizer_state: bool = False  # stage >= 1
    shard_params: bool = False  # stage 3
    axes: tuple = (ZERO_AXIS,)  # the mesh axes the `embed` dims are split over (data, and maybe context)

    @property
    def stage(self) -> int:
        return 3 if self.shard_params else 1 if self.shard_optimizer_state else 0

    @property
    def gathers_updated_params(self) -> bool:
        """Stage 1: gradients reduce-scattered to the state's shards, the updated parameters
        all-gathered back to their replicated layout after the update."""
        return self.shard_optimizer_state and not self.shard_params


def resolve_axes(choice: str, stage: int, mesh: dict) -> tuple:
    """`parallel.zero_axes` for this mesh (module doc): the axes, context only where it is > 1."""
    if choice == "auto":
        over_context = mesh[CONTEXT] > 1 and not (stage >= 3 and mesh[PIPELINE] > 1)
        return (DATA, CONTEXT) if over_context else (DATA,)
    axes = tuple(choice.split("+"))
    return axes if mesh[CONTEXT] > 1 else (DATA,)


def zero_plan(stage: int, axes: tuple = (ZERO_AXIS,)) -> ZeroPlan:
    return ZeroPlan(shard_optimizer_state=stage >= 1, shard_params=stage >= 3, axes=tuple(axes) if stage >= 1 else (ZERO_AXIS,))


def checks(config, mesh: dict) -> list[str]:
    parallel = config.parallel
    stage, choice = parallel.zero_stage, parallel.zero_axes
    if stage not in STAGES:
        return [f"parallel.zero_stage={stage} must be one of {STAGES}"]
    if choice not in AXES_CHOICES:
        return [f"parallel.zero_axes={choice!r} is not one of {AXES_CHOICES}"]
    axes = resolve_axes(choice, stage, mesh)
    if stage >= 3 and CONTEXT in axes and mesh[PIPELINE] > 1:
        return [
            f"parallel.zero_axes={choice!r} with parallel.zero_stage=3 and mesh.{PIPELINE}={mesh[PIPELINE]}: the "
            f"pipeline engine runs whole layers on every {CONTEXT} rank; set parallel.zero_axes to '{DATA}' or 'auto'"
        ]
    hidden = config.model.hidden_size
    shards = 1
    for axis in axes:
        shards *= mesh[axis]
    if stage >= 1 and hidden % shards:
        over = " x ".join(f"mesh.{a}" for a in axes)
        return [
            f"model.hidden_size={hidden} is not divisible by {over}={shards} (ZeRO shards the embed dim); "
            f"change model.hidden_size, the mesh, or parallel.zero_axes"
        ]
    return []


def in_use(rules, axes=(ZERO_AXIS,)):
    """The layout of parameters while they are used: ZeRO's split over `axes` removed (None: no mesh)."""
    return rules and rules.without(*axes)


def gather_layer(layer_params, layer_names, rules, plan: ZeroPlan):
    """Stage 3: one layer's parameters (a slice of the `[L, ...]` stacks, names without `layers`)
    all-gathered over the ZeRO axes now, just before use. Identity for stages 0 and 1."""
    if rules is None or not plan.shard_params:
        return layer_params
    return jax.tree.map(in_use(rules, plan.axes).constrain, layer_params, layer_names)


def _save_all_but_layouts(prim, *args, **params) -> bool:
    """A remat policy that saves every value except the outputs of sharding constraints. Those are
    identities on values, so the backward recomputes them from their (saved) inputs: a gathered
    layer is gathered again from its shard rather than kept whole."""
    del args, params
    return prim.name != "sharding_constraint"


def layer_remat_policy(policy, plan: ZeroPlan):
    """The remat policy of the layer scan. Stage 3 without remat would keep every layer's gathered
    parameters as scan residuals — all layers' full weights live until the backward, defeating
    ZeRO-3 (found by `jaxpar.analysis`) — so it saves everything but layouts instead. (Naming the
    gathered values is not enough: the gather itself is a sharding constraint whose output a
    save-all-but-names policy would keep.)"""
    if plan.shard_params and policy is None:
        return _save_all_but_layouts
    return policy


def constrain_grads(grads, opt_param_shardings, plan: ZeroPlan):
    """Stage >= 1: gradients laid out like the optimizer state, so their data-parallel reduction is
    a reduce-scatter rather than an all-reduce."""
    if not plan.shard_optimizer_state:
        return grads
    return jax.lax.with_sharding_constraint(grads, opt_param_shardings)
