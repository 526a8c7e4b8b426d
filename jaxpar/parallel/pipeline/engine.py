"""The pipeline engine: runs any valid schedule table inside `jax.shard_map` over `pipeline`.

What it shards: the decoder layers over `pipeline` (stage r holds its layers, see `layout.py`);
embedding, final norm and LM head are replicated over `pipeline`.

Manual axes: `pipeline`, plus the batch axes (`data`, `expert`) unless ZeRO-3 is on, plus
`context` with context parallelism (each context rank runs the schedule on its slice of the
sequence; attention's all-gathers / all-to-alls over `context` run inside the stage branches,
which every context rank of a pipeline rank takes together); tensor,
sequence parallelism (and ZeRO-3's `data`) stay with the partitioner inside every stage, so PP
composes with DP, ZeRO-1/3, TP, SP and expert-as-data. With manual batch axes every replica
accumulates its own gradients over the m microbatches and they are reduced once, after the
engine; under ZeRO-3 the partitioner reduce-scatters per microbatch instead, as FSDP does.

Collectives: per time step one `ppermute` of a microbatch's activations to rank r + 1 and one of
its output gradient to rank r - 1 (rings when v > 1); after the scan one psum over `pipeline` of
the shared parameters' gradients and of the loss.

Engine (per rank, a `lax.scan` over the table's T steps, carry `Carry`). Each step: store the
received gradient; run the cell's B or W (a `lax.switch` over the slot plan's `back_branches`),
recomputing the stage from its stashed input with `jax.vjp`; store the received activation
(after B/W, so a slot released this step takes it); run the F; then the two ppermutes; idle
ranks send zeros. Slots come from `slots.py`: a 1F1B rank holds at most min(m, 2(p - r) - 1)
stashed inputs, GPipe m.

Where the rest runs. Final norm + LM head + loss run inside the last stage: its F only keeps its
input, its B recomputes the stage with the loss on top (cotangent scale / m), so the loss
gradient is born where it is needed and 1F1B starts the backward the step after the forward.
The embedding runs in the engine but outside the branches, on every rank every step (a gather
for this step's F and one for its B/W, then the pullback of stage 0's input gradient into the
table, zero elsewhere): inside a branch the vocab-parallel gather makes the partitioner emit
collective-permutes, and the CPU runtime waits for every device at one, so ranks not taking the
branch would deadlock. Keeping the embedding in the engine makes its input tokens [m, mb, S+1],
not activations, so only the stash grows with m. The shared parameters' gradients are one psum
over `pipeline` at the end (so tied embeddings just add the first and last stages').

Proven equal to one device by `tests/test_pipeline.py` (every schedule, with data, expert-as-data,
tensor + SP, ZeRO-1/3, remat, tied embeddings) and, with context parallelism, by
`tests/test_context.py`; the slot plan by `tests/test_pipeline_slots.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import models
from jaxpar.axes import PIPELINE
from jaxpar.models.llama import default_positions
from jaxpar.parallel.context.plan import sequence_axes
from jaxpar.parallel.context.sequence import split_rows
from jaxpar.parallel.data import split_microbatches
from jaxpar.parallel.manual import vary_everywhere
from jaxpar.parallel.pipeline.layout import from_stages, to_stages
from jaxpar.parallel.pipeline.slots import FIELDS, FIRST, slot_plan_for
from jaxpar.parallel.pipeline.stage import Stage
from jaxpar.parallel.zero import in_use
from jaxpar.sharding import RESIDUAL, is_logical_names


class Carry(NamedTuple):
    acts: jax.Array  # [K_a + 1, mb, S, D]: stage inputs waiting for F, stashed for B/W
    grads: jax.Array  # [K_g + 1, mb, S, D]: output gradients waiting for B (and W)
    in_act: jax.Array  # what the forward ppermute delivered at the end of the previous step
    in_grad: jax.Array  # what the backward ppermute delivered
    layer_grads: Any  # [v, Lc, ...] fp32, this rank's stages
    shared_grads: Any  # embedding / norm / head, fp32
    loss: jax.Array  # fp32 sum of this rank's microbatch losses (last stage only)


def _inner_opts(opts, manual_axes):
    """Run options whose shardings name the shard_map's abstract mesh (pipeline, and the batch
    and sequence axes when manual, are Manual there: constraints must not name them)."""
    rules = opts.rules.without(*manual_axes).on(jax.sharding.get_abstract_mesh())
    return dataclasses.replace(opts, rules=rules)


def _add_at(acc, u, delta):
    return jax.tree.map(lambda a, d: a.at[u].add(d.astype(jnp.float32)), acc, delta)


def _add(acc, delta):
    return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, delta)


def _zeros_f32(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def _engine(staged, shared, inputs, targets, positions, tables, scale, *, plan, model_config, opts, shared_names,
            layer_names, batch_axes):
    p, m = plan.schedule.num_ranks, plan.schedule.num_microbatches
    dtype = opts.compute_dtype
    opts = _inner_opts(opts, batch_axes)
    stage, rules = Stage(model_config, opts), opts.rules
    # Every input is marked varying over all manual axes before any vjp: differentiating with
    # respect to a value replicated over `data` would psum its gradient over `data` right there.
    staged = jax.tree.map(lambda a: vary_everywhere(a[0].astype(dtype)), staged)  # [v, Lc, ...]
    # ZeRO-3: embedding / head (and their gradient sums) are gathered over `data` for the whole
    # step: left data-sharded, XLA's SPMD partitioner aborts on them when tensor > 1. Layers are
    # still gathered one at a time inside the layer scan.
    shared_rules = in_use(rules) if opts.plan.zero.shard_params else rules
    shared = jax.tree.map(
        lambda a, n: vary_everywhere(shared_rules.constrain(a.astype(dtype), n)), shared, shared_names,
        is_leaf=is_logical_names,
    )
    # Inputs and targets are split from the [S+1] rows outside (slicing them inside a branch can
    # make the partitioner emit a collective-permute there, which deadlocks ranks not taking it).
    inputs = vary_everywhere(rules.constrain(inputs, (None, "batch", None)))
    targets = vary_everywhere(rules.constrain(targets, (None, "batch", None)))
    positions = vary_everywhere(positions)
    rows = {k: t[:, 0] for k, t in tables.items()}
    loss_cotangent = vary_everywhere((scale / m).astype(jnp.float32))
    act_shape = inputs.shape[1:] + (model_config.hidden_size,)
    any_layer = jax.tree.map(lambda a: a[0], staged)  # merge needs *some* layers to embed

    def zeros_act(lead=()):
        return vary_everywhere(rules.constrain(jnp.zeros(lead + act_shape, dtype), (None,) * len(lead) + RESIDUAL))

    def layer(u):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u, keepdims=False), staged)

    def embed(shared, tokens):
        return stage.embed(any_layer, shared, tokens)

    def run_forward(x, u):
        return rules.constrain(stage.forward(False, layer(u), shared, x, positions, None), RESIDUAL)

    # fwd_branch 0: nothing to send (idle, or the last stage's F, which only keeps its input).
    fwd_branches = [lambda x, u: zeros_act(), run_forward]

    def backward_branch(branch):
        def run(x, output_grad, tgt, u, layer_grads, shared_grads, loss):
            cotangent = loss_cotangent if branch.last else output_grad
            d_layer, d_shared, d_input, mb_loss = stage.backward(
                branch, layer(u), shared, x, positions, tgt, cotangent
            )
            if d_layer is not None:
                layer_grads = _add_at(layer_grads, u, d_layer)
            if d_shared is not None:
                shared_grads = _add(shared_grads, d_shared)
            if branch.last and branch.inputs:  # each microbatch's loss once: at its B (full or input-grad)
                loss = loss + mb_loss
            d_input = zeros_act() if d_input is None else rules.constrain(d_input.astype(dtype), RESIDUAL)
            return d_input, layer_grads, shared_grads, loss

        return run

    def idle_back(x, output_grad, tgt, u, layer_grads, shared_grads, loss):
        return zeros_act(), layer_grads, shared_grads, loss

    back_branches = [idle_back] + [backward_branch(b) for b in plan.back_branches[1:]]
    ring = plan.schedule.virtual_stages > 1
    fwd_perm = [(r, (r + 1) % p) for r in range(p if ring else p - 1)]
    back_perm = [((r + 1) % p, r) for r in range(p if ring else p - 1)]

    def time_step(carry: Carry, row):
        with jax.named_scope("pipeline_step"):
            grads = jax.lax.dynamic_update_index_in_dim(carry.grads, carry.in_grad, row["recv_grad"], 0)
            # Embedding forward for this step's B/W microbatch (used if it is on stage 0), with its
            # pullback applied after the branch: gathers and scatters on the vocab-sharded table
            # run outside the branches on every rank (see the module docstring for why).
            x_first, embed_pullback = jax.vjp(lambda sh: embed(sh, inputs[row["back_mb"]]), shared)
            back_on_first = row["back_kind"] == FIRST
            x = jnp.where(back_on_first, x_first, carry.acts[row["back_slot"]])
            d_input, layer_grads, shared_grads, loss = jax.lax.switch(
                row["back_branch"], back_branches, x, grads[row["back_grad_slot"]], targets[row["back_mb"]],
                row["back_stage"], carry.layer_grads, carry.shared_grads, carry.loss,
            )
            zero = jnp.zeros_like(d_input)
            send_grad = jnp.where(back_on_first, zero, d_input)
            shared_grads = _add(shared_grads, embed_pullback(jnp.where(back_on_first, d_input, zero))[0])
            # After B/W: a slot it released this step may take this step's arrival.
            acts = jax.lax.dynamic_update_index_in_dim(carry.acts, carry.in_act, row["recv_act"], 0)
            x = jnp.where(row["fwd_kind"] == FIRST, embed(shared, inputs[row["fwd_mb"]]), acts[row["fwd_slot"]])
            send_act = jax.lax.switch(row["fwd_branch"], fwd_branches, x, row["fwd_stage"])
            return Carry(
                acts=acts,
                grads=grads,
                in_act=jax.lax.ppermute(send_act, PIPELINE, fwd_perm),
                in_grad=jax.lax.ppermute(send_grad, PIPELINE, back_perm),
                layer_grads=layer_grads,
                shared_grads=shared_grads,
                loss=loss,
            ), None

    start = Carry(
        acts=zeros_act((plan.act_slots + 1,)),
        grads=zeros_act((plan.grad_slots + 1,)),
        in_act=zeros_act(),
        in_grad=zeros_act(),
        layer_grads=jax.tree.map(
            lambda z, n: vary_everywhere(rules.constrain(z, (None, None) + n[1:])), _zeros_f32(staged), layer_names,
            is_leaf=is_logical_names,
        ),
        shared_grads=jax.tree.map(
            lambda z, n: vary_everywhere(shared_rules.constrain(z, n)), _zeros_f32(shared), shared_names,
            is_leaf=is_logical_names,
        ),
        loss=vary_everywhere(jnp.zeros((), jnp.float32)),
    )
    end, _ = jax.lax.scan(time_step, start, rows)
    shared_grads = jax.tree.map(
        shared_rules.constrain, jax.lax.psum(end.shared_grads, PIPELINE), shared_names, is_leaf=is_logical_names
    )
    # Per data replica: a leading axis over the manual batch axes (size 1 each), reduced outside.
    replicas = jax.lax.psum(1, batch_axes) if batch_axes else 1
    loss = jax.lax.psum(end.loss, (PIPELINE, *batch_axes)) / (m * replicas)
    return loss, jax.tree.map(lambda a: a[None, None], end.layer_grads), jax.tree.map(lambda a: a[None], shared_grads)


def pipelined_loss_and_grads(params, batch, *, model_config, opts, scale=1.0):
    """Same contract as `jaxpar.train.step.loss_and_grads`: (loss, fp32 unscaled grads, metrics),
    computed by the pipeline engine with the plan's pipeline options (microbatches replace
    `train.grad_accum`)."""
    pipe, rules = opts.plan.pipeline, opts.rules
    mesh = rules.mesh
    p, m, v = mesh.shape[PIPELINE], pipe.microbatches, pipe.virtual_stages
    plan = slot_plan_for(pipe.schedule, p, m, v)
    logical = models.logical_axes(model_config)
    staged = to_stages(params["layers"], logical["layers"], rules, p, v)
    shared = {k: a for k, a in params.items() if k != "layers"}
    micro = split_microbatches(batch, m, rules)
    # Context parallelism: tokens in the plan's sequence order, split over `context`, which is
    # manual here like the batch axes (every (replica, context rank) pair runs the schedule on its
    # shard; attention's collectives over `context` run inside the stage branches).
    inputs, targets, positions = split_rows(micro, opts.plan.context, rules, names=(None, "batch", "seq"))
    positions = default_positions(inputs[0]) if positions is None else positions[0]
    tables = {k: jnp.asarray(plan.tables[k]) for k in FIELDS}
    shared_names = {k: n for k, n in logical.items() if k != "layers"}
    # Data-parallel replicas (manual batch axes) accumulate their own gradients and reduce them
    # once, after the engine, not once per microbatch inside it. ZeRO-3 leaves the batch axes to
    # the partitioner: gradients reduce-scatter per microbatch there, as in FSDP.
    batch_axes = () if opts.plan.zero.shard_params else tuple(opts.plan.batch_axes)
    rows, seq = batch_axes or None, sequence_axes(opts.plan.context) or None
    # Per (replica, context rank) partial results, averaged below: each holds the mean over its tokens.
    batch_axes += sequence_axes(opts.plan.context)
    per_replica = batch_axes or None
    engine = functools.partial(
        _engine, plan=plan, model_config=model_config, opts=opts, shared_names=shared_names,
        layer_names=logical["layers"], batch_axes=batch_axes,
    )
    run = jax.shard_map(
        engine,
        mesh=mesh,
        in_specs=(P(PIPELINE), P(), P(None, rows, seq), P(None, rows, seq), P(rows, seq), P(None, PIPELINE), P()),
        out_specs=(P(), P(per_replica, PIPELINE), P(per_replica)),
        axis_names={PIPELINE, *batch_axes},
    )
    loss, layer_grads, shared_grads = run(
        staged, shared, inputs, targets, positions, tables, jnp.asarray(scale, jnp.float32)
    )
    layer_grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), layer_grads)
    shared_grads = jax.tree.map(
        lambda g, n: rules.constrain(jnp.mean(g, axis=0), n), shared_grads, shared_names, is_leaf=is_logical_names
    )
    grads = {**shared_grads, "layers": from_stages(layer_grads, logical["layers"], rules)}
    grads = jax.tree.map(lambda g: g / scale, grads)
    return loss, grads, {}
