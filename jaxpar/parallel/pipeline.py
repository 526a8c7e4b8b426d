"""The pipeline engine: runs any valid schedule table inside `jax.shard_map` over `pipeline`.

Manual axes: `pipeline`, plus the batch axes (`data`, `expert`) unless ZeRO-3 is on; tensor,
sequence parallelism (and ZeRO-3's `data`) stay with the partitioner inside every stage, so PP
composes with DP, ZeRO-1/3, TP, SP and expert-as-data. With manual batch axes every replica
accumulates its own gradients over the m microbatches and they are reduced once, after the
engine; under ZeRO-3 the partitioner reduce-scatters per microbatch instead, as FSDP does.

Layout. Parameters keep their mesh-independent shapes ([L, ...] stacks, logical axis `layers`,
which `build_table` maps to `pipeline` when it is > 1), so checkpoints stay portable. The engine
views the stack as [p, v, Lc, ...] with entry [r, u] = global stage u·p + r, i.e. layers
[(u·p + r)·Lc, (u·p + r + 1)·Lc), so the global layer order is kept. For v = 1 that is a free
reshape of the contiguous shards. For v > 1 rank r needs the strided chunks r, p + r, ... while
storage gives it the contiguous chunks r·v ... r·v + v - 1: the engine transposes once per step
(the partitioner emits an all-to-all + collective-permute of the layer params, and the same for
their gradients). Chosen over a mesh-dependent storage order (breaks portable checkpoints) and
over replicating the layers over `pipeline` (p× the memory). L must divide by p·v: uneven stages
are refused by preflight.

Engine (per rank, a `lax.scan` over the table's T steps). The carry holds
  acts [K_a+1, mb, S, D]  stage inputs: received-but-waiting activations and the stash for B/W,
  grads [K_g+1, mb, S, D] received output gradients waiting for B (and W when split),
  in_act, in_grad         what the two ppermutes delivered at the end of the previous step,
  layer grads [v, Lc, ...] and shared (embedding / norm / head) grads, fp32, and the loss sum.
Each step: store the received gradient; run the cell's B or W (a `lax.switch` over deduplicated
branches), recomputing the stage from its stashed input with `jax.vjp`; store the received
activation (after B/W, so a slot released this step takes it); run the F; then one ppermute
sends activations to rank r + 1 and one sends gradients to rank r - 1 (rings when v > 1); idle
ranks send zeros. Slots come from `pipeline_plan`: a 1F1B rank holds at most min(m, 2(p - r) - 1)
stashed inputs, GPipe m.

Where the rest runs. Final norm + LM head + loss run inside the last stage: its F only keeps its
input, its B recomputes the stage with the loss on top (cotangent scale / m), so the loss
gradient is born where it is needed and 1F1B starts the backward the step after the forward.
The embedding runs in the engine but outside the branches, on every rank every step (a gather
for this step's F and one for its B/W, then the pullback of stage 0's input gradient into the
table, zero elsewhere): inside a branch the vocab-parallel gather makes the partitioner emit
collective-permutes, and the CPU runtime waits for every device at one, so ranks not taking the
branch would deadlock. Keeping the embedding in the engine makes its input tokens [m, mb, S+1],
not activations, so only the stash grows with m. Shared params (embedding, norm, head) are
replicated over `pipeline`; their gradients are one psum over `pipeline` at the end (so tied
embeddings just add the first and last stages' contributions).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import models
from jaxpar.parallel.pipeline_plan import FIELDS, FIRST, IDLE, LAST, MIDDLE, W_OFFSET, plan_for
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


def _manual_axes():
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual)


def _vary(x):
    """Marks a per-device value as varying over every manual axis (no-op where it already is)."""
    varying = jax.typeof(x).manual_axis_type.varying  # (jax 0.10's name for the old `.vma`)
    missing = tuple(a for a in _manual_axes() if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _inner_opts(opts, batch_axes):
    """Run options whose shardings name the shard_map's abstract mesh (pipeline, and the batch
    axes when manual, are Manual there: constraints must not name them)."""
    mesh = jax.sharding.get_abstract_mesh()
    inner = lambda rules: rules and Rules(mesh, rules.without(*batch_axes).table)  # noqa: E731
    return dataclasses.replace(opts, rules=inner(opts.rules), gathered_rules=inner(opts.gathered_rules))


def _add_at(acc, u, delta):
    return jax.tree.map(lambda a, d: a.at[u].add(d.astype(jnp.float32)), acc, delta)


def _add(acc, delta):
    return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, delta)


def _engine(
    staged, shared, micro, tables, scale, *, plan, model_config, opts, dtype, shared_names, layer_names, batch_axes
):
    p, m = plan.schedule.num_ranks, plan.schedule.num_microbatches
    opts = _inner_opts(opts, batch_axes)
    stage, rules = Stage(model_config, opts), opts.rules
    # Every input is marked varying over all manual axes before any vjp: differentiating with
    # respect to a value replicated over `data` would psum its gradient over `data` right there.
    staged = jax.tree.map(lambda a: _vary(a[0].astype(dtype)), staged)  # [v, Lc, ...]
    # ZeRO-3: embedding / head (and their gradient sums) are gathered over `data` for the whole
    # step: left data-sharded, XLA's SPMD partitioner aborts on them when tensor > 1. Layers are
    # still gathered one at a time inside the layer scan.
    shared_rules = opts.gathered_rules or rules
    shared = jax.tree.map(
        lambda a, n: _vary(shared_rules.constrain(a.astype(dtype), n)), shared, shared_names, is_leaf=_is_names
    )
    # Inputs and targets split once here: slicing [S+1] rows inside a branch can make the
    # partitioner emit a collective-permute there, which deadlocks ranks not taking the branch.
    inputs = _vary(rules.constrain(micro[:, :, :-1], (None, "batch", None)))
    targets = _vary(rules.constrain(micro[:, :, 1:], (None, "batch", None)))
    rows = {k: t[:, 0] for k, t in tables.items()}
    ct_loss = _vary((scale / m).astype(jnp.float32))
    act_shape = inputs.shape[1:] + (model_config.hidden_size,)
    any_layer = jax.tree.map(lambda a: a[0], staged)  # merge needs *some* layers to embed

    def zeros_act(lead=()):
        return _vary(rules.constrain(jnp.zeros(lead + act_shape, dtype), (None,) * len(lead) + ACT))

    def layer(u):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u, keepdims=False), staged)

    def embed(shared, tokens):
        return stage.embed(any_layer, shared, tokens)

    def forward(x, u):
        return rules.constrain(stage.forward(MIDDLE, layer(u), shared, x, None), ACT)

    # F: run the layers on first / middle stages; the last stage's F only keeps its input.
    f_index = jnp.asarray([0, 1, 1, 0], jnp.int32)[rows["f_kind"]]
    f_branches = [lambda x, u: zeros_act(), forward]

    def backward(last: bool, params: bool, inputs: bool):
        """-> (input gradient, layer grads, shared grads, loss) of one B or W."""

        def run(x, g, tgt, u, gl, gs, loss):
            ct = ct_loss if last else g
            kind = LAST if last else MIDDLE
            d_layer, d_shared, dx, l = stage.backward(kind, layer(u), shared, x, tgt, ct, params=params, inputs=inputs)
            if d_layer is not None:
                gl = _add_at(gl, u, d_layer)
            if d_shared is not None:
                gs = _add(gs, d_shared)
            if last and inputs:  # each microbatch's loss once: at its B (full or input-grad)
                loss = loss + l
            dx = zeros_act() if dx is None else rules.constrain(dx.astype(dtype), ACT)
            return dx, gl, gs, loss

        return run

    # B/W branches, deduplicated: first and middle stages differ only in where the input gradient
    # goes (stage 0's feeds the embedding's weight gradient instead of the ppermute).
    signatures = [None]  # branch 0: idle
    k_map = []
    for code in range(W_OFFSET + LAST + 1):
        kind, is_w = (code - W_OFFSET, True) if code > W_OFFSET else (code, False)
        wants_params = is_w or not plan.split_backward
        wants_input = (not is_w and kind != FIRST) or (kind == FIRST and wants_params)
        busy = kind != IDLE and (wants_params or wants_input)
        sig = (kind == LAST, wants_params, wants_input) if busy else None
        if sig not in signatures:
            signatures.append(sig)
        k_map.append(signatures.index(sig))
    k_index = jnp.asarray(k_map, jnp.int32)[rows["k_kind"]]
    k_branches = [(lambda x, g, tgt, u, gl, gs, loss: (zeros_act(), gl, gs, loss))] + [
        backward(*sig) for sig in signatures[1:]
    ]
    ring = plan.schedule.virtual_stages > 1
    fwd_perm = [(r, (r + 1) % p) for r in range(p if ring else p - 1)]
    bwd_perm = [((r + 1) % p, r) for r in range(p if ring else p - 1)]

    def body(carry, row):
        acts, grads, in_act, in_grad, gl, gs, loss = carry
        grads = jax.lax.dynamic_update_index_in_dim(grads, in_grad, row["recv_grad"], 0)
        # Embedding forward for this step's B/W microbatch (used if it is on stage 0), with its
        # pullback applied after the branch: gathers and scatters on the vocab-sharded table
        # run outside the branches on every rank (see `inputs` above for why).
        x_first, embed_pullback = jax.vjp(lambda sh: embed(sh, inputs[row["k_mb"]]), shared)
        on_first = (row["k_kind"] == FIRST) | (row["k_kind"] == W_OFFSET + FIRST)
        x = jnp.where(on_first, x_first, acts[row["k_slot"]])
        dx, gl, gs, loss = jax.lax.switch(
            row["k_index"], k_branches, x, grads[row["k_gslot"]], targets[row["k_mb"]], row["k_stage"], gl, gs, loss
        )
        zero = jnp.zeros_like(dx)
        send_grad = jnp.where(on_first, zero, dx)
        gs = _add(gs, embed_pullback(jnp.where(on_first, dx, zero))[0])
        # After B/W: a slot it released this step may take this step's arrival.
        acts = jax.lax.dynamic_update_index_in_dim(acts, in_act, row["recv_act"], 0)
        x = jnp.where(row["f_kind"] == FIRST, embed(shared, inputs[row["f_mb"]]), acts[row["f_slot"]])
        send_act = jax.lax.switch(row["f_index"], f_branches, x, row["f_stage"])
        in_act = jax.lax.ppermute(send_act, AXIS, fwd_perm)
        in_grad = jax.lax.ppermute(send_grad, AXIS, bwd_perm)
        return (acts, grads, in_act, in_grad, gl, gs, loss), None

    carry = (
        zeros_act((plan.act_slots + 1,)),
        zeros_act((plan.grad_slots + 1,)),
        zeros_act(),
        zeros_act(),
        jax.tree.map(
            lambda z, n: _vary(rules.constrain(z, (None, None) + n[1:])), zeros_f32(staged), layer_names, is_leaf=_is_names
        ),
        jax.tree.map(lambda z, n: _vary(shared_rules.constrain(z, n)), zeros_f32(shared), shared_names, is_leaf=_is_names),
        _vary(jnp.zeros((), jnp.float32)),
    )
    (_, _, _, _, gl, gs, loss), _ = jax.lax.scan(body, carry, {**rows, "f_index": f_index, "k_index": k_index})
    gs = jax.tree.map(shared_rules.constrain, jax.lax.psum(gs, AXIS), shared_names, is_leaf=_is_names)
    # Per data replica: a leading axis over the manual batch axes (size 1 each), reduced outside.
    replicas = jax.lax.psum(1, batch_axes) if batch_axes else 1
    loss = jax.lax.psum(loss, (AXIS, *batch_axes)) / (m * replicas)
    return loss, jax.tree.map(lambda a: a[None, None], gl), jax.tree.map(lambda a: a[None], gs)


def pipelined_loss_and_grads(params, batch, *, model_config, opts, accum: int = 1, scale=1.0):
    """Same contract as `jaxpar.train.step.loss_and_grads`: (loss, fp32 unscaled grads, metrics),
    computed by the pipeline engine with `opts.pipeline` (microbatches replace `accum`)."""
    if accum != 1:
        raise ValueError(f"pipeline parallelism needs train.grad_accum == 1 (got {accum}); use parallel.num_microbatches")
    pipe, rules = opts.pipeline, opts.rules
    mesh = rules.mesh
    p, m, v = mesh.shape[AXIS], pipe.microbatches, pipe.virtual_stages
    plan = plan_for(pipe.schedule, p, m, v)
    logical = models.logical_axes(model_config)
    staged = to_stages(params["layers"], logical["layers"], rules, p, v)
    shared = {k: a for k, a in params.items() if k != "layers"}
    micro = split_microbatches(batch, m, rules)
    tables = {k: jnp.asarray(plan.tables[k]) for k in FIELDS}
    shared_names = {k: n for k, n in logical.items() if k != "layers"}
    # Data-parallel replicas (manual batch axes) accumulate their own gradients and reduce them
    # once, after the engine, not once per microbatch inside it. ZeRO-3 leaves the batch axes to
    # the partitioner: gradients reduce-scatter per microbatch there, as in FSDP.
    batch_axes = () if opts.gathered_rules is not None else tuple(rules.table["batch"])
    per_replica = batch_axes or None
    engine = functools.partial(
        _engine, plan=plan, model_config=model_config, opts=opts, dtype=opts.compute_dtype, shared_names=shared_names,
        layer_names=logical["layers"], batch_axes=batch_axes,
    )
    run = jax.shard_map(
        engine,
        mesh=mesh,
        in_specs=(P(AXIS), P(), P(None, per_replica), P(None, AXIS), P()),
        out_specs=(P(), P(per_replica, AXIS), P(per_replica)),
        axis_names={AXIS, *batch_axes},
    )
    loss, layer_grads, shared_grads = run(staged, shared, micro, tables, jnp.asarray(scale, jnp.float32))
    layer_grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), layer_grads)
    shared_grads = jax.tree.map(
        lambda g, n: rules.constrain(jnp.mean(g, axis=0), n), shared_grads, shared_names, is_leaf=_is_names
    )
    grads = {**shared_grads, "layers": from_stages(layer_grads, logical["layers"], rules)}
    grads = jax.tree.map(lambda g: g / scale, grads)
    return loss, grads, {}
