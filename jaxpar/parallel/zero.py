"""ZeRO over `data`: stage 1 shards optimizer state, stage 3 (FSDP) also shards parameters.

What it shards: every parameter dim with logical name `embed` is split over `data` — in the
optimizer state (Adam moments) from stage 1, in the parameters too at stage 3. Norm scales are
never split (too small to matter). The rules table (`jaxpar.sharding`) reads `ZeroPlan` to place
`data` there.

Collectives: stage 1 — the gradient reduction becomes a reduce-scatter to the optimizer-state
layout (`constrain_grads`), and the updated parameters are all-gathered back to their replicated
layout. Stage 3 — each layer's parameters are all-gathered inside the layer scan just before use
(`gather_layer`; again in the backward, whatever the remat policy: `layer_remat_policy`), one
layer at a time, and gradients are reduce-scattered per microbatch, as FSDP does.

Proven equal to one device by `tests/test_degeneracy.py` (zero1, zero3, zero3 + tensor + SP);
the memory division by `tests/test_compiled.py::test_zero_stages_divide_memory_over_data`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxpar.axes import DATA

STAGES = (0, 1, 3)
# The mesh axis ZeRO shards over.
ZERO_AXIS = DATA


@dataclass(frozen=True)
class ZeroPlan:
    shard_optimizer_state: bool = False  # stage >= 1
    shard_params: bool = False  # stage 3

    @property
    def stage(self) -> int:
        return 3 if self.shard_params else 1 if self.shard_optimizer_state else 0

    @property
    def gathers_updated_params(self) -> bool:
        """Stage 1: gradients reduce-scattered to the state's shards, the updated parameters
        all-gathered back to their replicated layout after the update."""
        return self.shard_optimizer_state and not self.shard_params


def zero_plan(stage: int) -> ZeroPlan:
    return ZeroPlan(shard_optimizer_state=stage >= 1, shard_params=stage >= 3)


def checks(config, mesh: dict) -> list[str]:
    stage = config.parallel.zero_stage
    if stage not in STAGES:
        return [f"parallel.zero_stage={stage} must be one of {STAGES}"]
    hidden, data = config.model.hidden_size, mesh[ZERO_AXIS]
    if stage >= 1 and hidden % data:
        return [
            f"model.hidden_size={hidden} is not divisible by mesh.{ZERO_AXIS}={data} (ZeRO shards the embed dim); "
            f"change model.hidden_size or mesh.{ZERO_AXIS}"
        ]
    return []


def in_use(rules):
    """The layout of parameters while they are used: ZeRO's `data` split removed (None: no mesh)."""
    return rules and rules.without(ZERO_AXIS)


def gather_layer(layer_params, layer_names, rules, plan: ZeroPlan):
    """Stage 3: one layer's parameters (a slice of the `[L, ...]` stacks, names without `layers`)
    all-gathered over `data` now, just before use. Identity for stages 0 and 1."""
    if rules is None or not plan.shard_params:
        return layer_params
    return jax.tree.map(in_use(rules).constrain, layer_params, layer_names)


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
