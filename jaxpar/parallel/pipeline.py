"""The pipeline engine: runs any valid schedule table inside `jax.shard_map` over `pipeline`.

Only `pipeline` is manual (`axis_names={"pipeline"}`); data, tensor, ZeRO, sequence and expert
sharding stay with the partitioner inside every stage, so PP composes with all of them.

Layout. Parameters keep their mesh-independent shapes ([L, ...] stacks, logical axis `layers`,
which `build_table` maps to `pipeline` when it is > 1), so checkpoints stay portable. The engine
views the stack as [p, v, Lc, ...] with entry [r, u] = global stage u·p + r, i.e. layers
[(u·p + r)·Lc, (u·p + r + 1)·Lc). For v = 1 that is a free reshape of the contiguous shards.
For v > 1 rank r needs the strided chunks r, p + r, ... while storage gives it the contiguous
chunks r·v ... r·v + v - 1; the engine moves them with one transpose per step, which the
partitioner lowers to a collective-permute of (v - 1)/v of the layer params (and the same for the
gradients back). That was preferred over a mesh-dependent storage order (breaks portable
checkpoints) and over replicating layers over `pipeline` (p× the memory). L must divide by p·v.

Engine (per rank, a `lax.scan` over the table's T steps). The carry holds
  acts [K_a+1, mb, S, D]  stage inputs: received-but-waiting activations and the stash for B/W,
  grads [K_g+1, mb, S, D] received output gradients waiting for B (and W when split),
  in_act, in_grad         what the two ppermutes delivered at the end of the previous step,
  layer grads [v, Lc, ...] and shared (embedding / norm / head) grads, fp32, and the loss sum.
Each step: store the received gradient; run the cell's B or W (a `lax.switch` on the table's
branch code: idle / first / middle / last stage), recomputing from the stash; store the received
activation (after B/W, so a slot released this step takes it); run the F; then one ppermute
sends activations to rank r + 1 and one sends gradients to rank r - 1 (rings when v > 1). Idle
ranks send zeros. Slots come from `pipeline_plan`, so a 1F1B rank holds at most
min(m, 2(p - r) - 1) stashed inputs while GPipe holds m.

Where the rest runs: embedding inside the first stage's F (its gradient inside that stage's
backward), final norm + LM head + loss inside the last stage, whose F only stashes its input
and whose B recomputes the stage with the loss on top (cotangent scale / m) — the loss is born
on the rank that needs its gradient, with no extra round trip. Keeping the embedding in the
engine makes the engine input tokens [m, mb, S+1], not activations, so only the stash grows
with m. Shared params are replicated over `pipeline`; their gradients are one psum at the end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.pipeline_plan import FIELDS, FIRST, IDLE, LAST, MIDDLE, plan_for
from jaxpar.parallel.pipeline_stage import Stage, zeros_f32
from jaxpar.sharding import Rules
from jaxpar.train.step import split_microbatches

AXIS = "pipeline"
ACT = ("batch", "act_seq", "act_embed")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1


def pipeline_options(config, mesh_shape) -> PipelineOptions | None:
    """From `config.parallel`; None when the pipeline axis is 1. Microbatches 0 means p."""
    p = mesh_shape["pipeline"]
    if p == 1:
        return None
    parallel = config.parallel
    m = parallel.num_microbatches or p
    return PipelineOptions(parallel.pipeline_schedule, m, parallel.virtual_stages)


# --- parameter layout ---------------------------------------------------------------------


def _stage_spec(rules: Rules, names) -> P:
    rest = tuple(rules.spec(names))[1:]
    return P(AXIS, None, None, *rest)


def to_stages(layers, logical, rules: Rules, p: int, v: int):
    """[L, ...] → [p, v, Lc, ...], entry [r, u] = global stage u·p + r, sharded over pipeline."""

    def one(a, names):
        chunk = a.shape[0] // (p * v)
        staged = a.reshape(v, p, chunk, *a.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(staged, NamedSharding(rules.mesh, _stage_spec(rules, names)))

    return jax.tree.map(one, layers, logical, is_leaf=_is_names)


def from_stages(staged, logical, rules: Rules):
    """The inverse of `to_stages`, back to the storage layout [L, ...]."""

    def one(a, names):
        flat = a.swapaxes(0, 1).reshape(-1, *a.shape[3:])
        return jax.lax.with_sharding_constraint(flat, rules.sharding(names))

    return jax.tree.map(one, staged, logical, is_leaf=_is_names)


def _is_names(x):
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


# --- the engine -------------------------------------------------------------------------------


def _vary(x):
    """Marks a per-rank value as varying over `pipeline` (no-op if it already is)."""
    varying = jax.typeof(x).manual_axis_type.varying  # (jax 0.10's name for the old `.vma`)
    return x if AXIS in varying else jax.lax.pcast(x, (AXIS,), to="varying")


def _inner_opts(opts):
    """Run options whose shardings name the shard_map's abstract mesh (pipeline is Manual there)."""
    mesh = jax.sharding.get_abstract_mesh()
    gathered = opts.gathered_rules and Rules(mesh, opts.gathered_rules.table)
    return dataclasses.replace(opts, rules=Rules(mesh, opts.rules.table), gathered_rules=gathered)


def _add_at(acc, u, delta):
    return jax.tree.map(lambda a, d: a.at[u].add(d.astype(jnp.float32)), acc, delta)


def _add(acc, delta):
    return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, delta)


def _engine(staged, shared, micro, tables, scale, *, plan, model_config, opts, dtype):
    p, m = plan.schedule.num_ranks, plan.schedule.num_microbatches
    opts = _inner_opts(opts)
    stage = Stage(model_config, opts)
    rules = opts.rules
    staged = jax.tree.map(lambda a: a[0].astype(dtype), staged)  # [v, Lc, ...]
    shared = jax.tree.map(lambda a: _vary(a.astype(dtype)), shared)
    micro = _vary(micro)
    rows = {k: t[:, 0] for k, t in tables.items()}
    ct_loss = _vary((scale / m).astype(jnp.float32))
    _, mb, width = micro.shape
    act_shape = (mb, width - 1, model_config.hidden_size)

    def zeros_act(lead=()):
        z = jnp.zeros(lead + act_shape, dtype)
        return _vary(rules.constrain(z, (None,) * len(lead) + ACT))

    def layer(u):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u, keepdims=False), staged)

    # Forward-type branches: return what this rank sends forward.
    def f_branch(kind):
        def run(acts, row):
            if kind in (IDLE, LAST):  # the last stage's F only keeps its input (already in acts)
                return zeros_act()
            tokens = micro[row["f_mb"]]
            x = acts[row["f_slot"]]
            return rules.constrain(stage.forward(kind, layer(row["f_stage"]), shared, x, tokens), ACT)

        return run

    # Backward-type branches: (sent gradient, layer grads, shared grads, loss sum).
    def bw_branch(kind, key, *, params, inputs):
        def run(acts, grads, gl, gs, loss, row):
            if kind == IDLE or (kind == FIRST and not params):
                return zeros_act(), gl, gs, loss
            u, tokens = row[f"{key}_stage"], micro[row[f"{key}_mb"]]
            ct = ct_loss if kind == LAST else grads[row[f"{key}_gslot"]]
            d_layer, d_shared, dx, l = stage.backward(
                kind, layer(u), shared, acts[row[f"{key}_slot"]], tokens, ct, params=params, inputs=inputs
            )
            if d_layer is not None:
                gl = _add_at(gl, u, d_layer)
            if d_shared is not None:
                gs = _add(gs, d_shared)
            if l is not None and inputs:  # count each microbatch's loss once (at B, not W)
                loss = loss + l
            send = zeros_act() if dx is None else rules.constrain(dx.astype(dtype), ACT)
            return send, gl, gs, loss

        return run

    split = plan.split_backward
    kinds = (IDLE, FIRST, MIDDLE, LAST)
    f_branches = [f_branch(k) for k in kinds]
    b_branches = [bw_branch(k, "b", params=not split, inputs=True) for k in kinds]
    w_branches = [bw_branch(k, "w", params=True, inputs=False) for k in kinds]
    ring = plan.schedule.virtual_stages > 1
    fwd_perm = [(r, (r + 1) % p) for r in range(p if ring else p - 1)]
    bwd_perm = [((r + 1) % p, r) for r in range(p if ring else p - 1)]

    def body(carry, row):
        acts, grads, in_act, in_grad, gl, gs, loss = carry
        grads = jax.lax.dynamic_update_index_in_dim(grads, in_grad, row["recv_grad"], 0)
        send_grad, gl, gs, loss = jax.lax.switch(row["b_kind"], b_branches, acts, grads, gl, gs, loss, row)
        if split:
            _, gl, gs, loss = jax.lax.switch(row["w_kind"], w_branches, acts, grads, gl, gs, loss, row)
        acts = jax.lax.dynamic_update_index_in_dim(acts, in_act, row["recv_act"], 0)
        send_act = jax.lax.switch(row["f_kind"], f_branches, acts, row)
        in_act = jax.lax.ppermute(send_act, AXIS, fwd_perm)
        in_grad = jax.lax.ppermute(send_grad, AXIS, bwd_perm)
        return (acts, grads, in_act, in_grad, gl, gs, loss), None

    carry = (
        zeros_act((plan.act_slots + 1,)),
        zeros_act((plan.grad_slots + 1,)),
        zeros_act(),
        zeros_act(),
        jax.tree.map(_vary, zeros_f32(staged)),
        jax.tree.map(_vary, zeros_f32(shared)),
        _vary(jnp.zeros((), jnp.float32)),
    )
    (_, _, _, _, gl, gs, loss), _ = jax.lax.scan(body, carry, rows)
    loss = jax.lax.psum(loss, AXIS) / m
    gs = jax.lax.psum(gs, AXIS)
    return loss, jax.tree.map(lambda a: a[None], gl), gs


def pipelined_loss_and_grads(params, batch, *, model_config, opts, accum: int = 1, scale=1.0):
    """Same contract as `jaxpar.train.step.loss_and_grads`: (loss, fp32 unscaled grads, metrics),
    computed by the pipeline engine with `opts.pipeline` (microbatches replace `accum`)."""
    if accum != 1:
        raise ValueError(f"pipeline parallelism needs train.grad_accum == 1 (got {accum}); use parallel.num_microbatches")
    pipe, rules = opts.pipeline, opts.rules
    mesh = rules.mesh
    p, m, v = mesh.shape[AXIS], pipe.microbatches, pipe.virtual_stages
    plan = plan_for(pipe.schedule, p, m, v)
    from jaxpar import models  # late: models imports nothing from here, but keep the graph light

    logical = models.logical_axes(model_config)
    staged = to_stages(params["layers"], logical["layers"], rules, p, v)
    shared = {k: a for k, a in params.items() if k != "layers"}
    micro = split_microbatches(batch, m, rules)
    tables = {k: jnp.asarray(plan.tables[k]) for k in FIELDS}
    engine = functools.partial(_engine, plan=plan, model_config=model_config, opts=opts, dtype=opts.compute_dtype)
    run = jax.shard_map(
        engine,
        mesh=mesh,
        in_specs=(P(AXIS), P(), P(), P(None, AXIS), P()),
        out_specs=(P(), P(AXIS), P()),
        axis_names={AXIS},
    )
    loss, layer_grads, shared_grads = run(staged, shared, micro, tables, jnp.asarray(scale, jnp.float32))
    grads = {**shared_grads, "layers": from_stages(layer_grads, logical["layers"], rules)}
    grads = jax.tree.map(lambda g: g / scale, grads)
    return loss, grads, {}
