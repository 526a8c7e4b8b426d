"""The engine's `jax.shard_map`: what each rank receives and returns, and over which axes it is manual.

`setup` splits the global batch into the plan's microbatches (and, with context parallelism, each
row into the plan's sequence order), builds the schedule's rank and step tables and the stage
layout, derives every input's and output's spec from the logical names (the layers staged over
`pipeline`; the shared params — embedding, head, final norm and whatever the end stages run
besides their layers, `stage.Ends` — replicated over it or split by vocab), and wraps the per-rank
program (`engine._engine`) in one shard_map. With multi-token prediction on the last stage, the
tokens ahead of every position (`jaxpar.parallel.context.sequence.Ahead`) are computed here on
whole rows in text order, as the non-pipelined step does, and travel beside the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.axes import PIPELINE
from jaxpar.manual import manual_spec
from jaxpar.parallel.context.plan import sequence_axes
from jaxpar.parallel.context.sequence import default_positions, split_ahead, split_rows
from jaxpar.parallel.data import split_microbatches
from jaxpar.parallel.pipeline.layout import stage_layout
from jaxpar.parallel.pipeline.slots import STEP_FIELDS
from jaxpar.parallel.pipeline.stage import Ends, StageModel
from jaxpar.sharding import is_logical_names


def spec_axes(spec) -> set:
    return {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}


def _per_replica(spec, batch_axes) -> P:
    """`spec` behind a leading per-replica axis over the batch axes it does not already use."""
    lead = tuple(a for a in batch_axes if a not in spec_axes(spec))
    return P(lead or None, *spec)


@functools.lru_cache(maxsize=64)
def _layout(split, p, v, stages, stored):
    return stage_layout(split, p, v, stages, stored)


def setup(engine, params, batch, model: StageModel, opts, train: bool, per_token: bool = False):
    """The shard_map of `engine` for this plan (`train`: with gradients; else the loss only, or
    with `per_token` every target's loss [m, mb, S]), its arguments (scale last, to fill in), and
    the batch axes it is manual over."""
    pipe, rules = opts.plan.pipeline, opts.rules
    mesh = rules.mesh
    plan = pipe.slot_plan
    p, m, v = mesh.shape[PIPELINE], pipe.microbatches, pipe.virtual_stages
    if (plan.schedule.num_ranks, plan.schedule.num_microbatches, plan.schedule.virtual_stages) != (p, m, v):
        raise ValueError(f"pipeline table {plan.schedule.name!r} is not for p={p}, m={m}, v={v}")
    layout = _layout(pipe.stage_layers, p, v, plan.schedule.stages, pipe.stored_order)
    logical = model.logical
    shared = {k: a for k, a in params.items() if k != "layers"}
    shared_names = {k: n for k, n in logical.items() if k != "layers"}
    micro = split_microbatches(batch, m, rules)
    # Context parallelism: tokens in the plan's sequence order, split over `context`, which is
    # manual here like the batch axes (every (replica, context rank) pair runs the schedule on its
    # shard; attention's collectives over `context` run inside the stage branches).
    seq = split_rows(micro, opts.plan.context, rules, names=(None, "batch", "seq"))
    if seq.positions is None:
        seq = seq._replace(positions=jnp.broadcast_to(default_positions(seq.tokens[0]), seq.tokens.shape))
    ends = Ends.of(model, params, opts, train)
    depth = ends.prediction_depth
    # [m, D, mb, S]: each microbatch's tokens ahead (none without multi-token prediction).
    ahead = () if not depth else jax.tree.map(
        lambda a: jnp.swapaxes(a, 0, 1), split_ahead(micro, depth, opts.plan.context, rules, names=(None, "batch", "seq"))
    )
    rank_tables = {k: jnp.asarray(t) for k, t in plan.tables.items()}
    steps = {k: jnp.asarray(plan.steps[k]) for k in STEP_FIELDS}
    layout_tables = {k: jnp.asarray(t) for k, t in layout.tables.items()}
    # Data-parallel replicas (manual batch axes) accumulate their own gradients and reduce them
    # once, after the engine, not once per microbatch inside it. ZeRO-3 leaves the batch axes to
    # the partitioner: gradients reduce-scatter per microbatch there, as in FSDP.
    batch_axes = () if opts.plan.zero.shard_params else tuple(opts.plan.batch_axes)
    rows, seq_axes = batch_axes or None, sequence_axes(opts.plan.context) or None
    # Per (replica, context rank) partial results, averaged below: each holds the mean over its tokens.
    batch_axes += sequence_axes(opts.plan.context)
    manual = {PIPELINE, *batch_axes}
    spec = functools.partial(manual_spec, rules, manual=manual)
    layer_specs = jax.tree.map(spec, logical["layers"], is_leaf=is_logical_names)
    shared_specs = jax.tree.map(spec, shared_names, is_leaf=is_logical_names)
    replica_grads = lambda specs: jax.tree.map(  # noqa: E731
        lambda s: _per_replica(s, batch_axes), specs, is_leaf=lambda x: isinstance(x, P)
    )
    layer_grad_specs = replica_grads(layer_specs)  # the storage layout (split over `pipeline` or not)
    # Split over `pipeline` ("spread" tables) or summed over it; a shared leaf split over a manual
    # batch axis (an end stage's experts, over `expert`) keeps that split, as the layers do.
    shared_grad_specs = jax.tree.map(
        lambda s: _per_replica(s if spec_axes(s) else P(), batch_axes), shared_specs, is_leaf=lambda x: isinstance(x, P),
    )
    run = jax.shard_map(
        functools.partial(
            engine, plan=plan, layout=layout, stage_model=model, opts=opts, shared_names=shared_names,
            batch_axes=batch_axes, vocab=pipe.vocab, ends=ends, train=train, per_token=per_token,
        ),
        mesh=mesh,
        in_specs=(
            layer_specs, shared_specs, jax.tree.map(lambda _: P(None, rows, seq_axes), seq),
            jax.tree.map(lambda _: P(None, None, rows, seq_axes), ahead), P(None, PIPELINE), P(PIPELINE), P(), P(),
        ),
        out_specs=(P(), layer_grad_specs, shared_grad_specs, P()) if train else P(None, rows, seq_axes) if per_token else P(),
        axis_names=manual,
    )
    return run, (params["layers"], shared, seq, ahead, rank_tables, layout_tables, steps), batch_axes
