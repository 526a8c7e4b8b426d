"""The pipeline engine: runs any valid schedule table inside `jax.shard_map` over `pipeline`.

What it shards: the decoder layers over `pipeline`, in any split into stages (`balance.py`,
`layout.py`: storage stays [L, ...]); the embedding and LM head by vocab over `pipeline` ×
`tensor` (`vocab.py`), so no rank holds a whole table; the final norm is replicated.

Manual axes: `pipeline`, plus the batch axes (`data`, `expert`) unless ZeRO-3 is on, plus
`context` with context parallelism (each context rank runs the schedule on its slice of the
sequence; attention's all-gathers / all-to-alls over `context` run inside the stage branches,
which every context rank of a pipeline rank takes together); tensor,
sequence parallelism (and ZeRO-3's `data`) stay with the partitioner inside every stage, so PP
composes with DP, ZeRO-1/3, TP, SP, expert-as-data and expert parallelism (MoE layers run their
dispatch per device, with the all-to-all over `expert`). With manual batch axes every replica
accumulates its own gradients over the m microbatches and they are reduced once, after the
engine; under ZeRO-3 the partitioner reduce-scatters per microbatch instead, as FSDP does.

Collectives: before the scan, the layer exchange of an uneven split or a non-modular stage map
(`layout.py`; none for an equal split stored in the schedule's order). Per time step, for each
rank distance d a stage-to-stage hop of the table's stage
map uses (`Schedule.hops`), one `ppermute` of the step's stage output by +d and one of its input
gradient by -d, and the vocab-parallel all-reduces over `pipeline` (`vocab.py`). The modular map
(stage s on rank s % p) uses d = 1 only: one ppermute each way per step (rings when v > 1); a V
shape (rank r holding stages r and 2p - 1 - r) uses d = 1 and d = p - 1 (one ppermute when
p = 2), plus d = 0, the hop between the two stages on rank p - 1, which needs no collective (the
value stays on the rank and is read next step, as an arrival would be): 4 ppermutes per step at
p > 2 (2 at p = 2). Fewer is impossible without packing: in a V, rank r sends one stage's output
down and the other's up in the same step, and a ppermute sends one buffer per device, so each
direction needs its own; packing the activation and the gradient that go the same way into one
buffer would halve the count at the same bytes. Every rank sends its step
output over every hop (zeros when idle), so each ppermute runs on every rank every step, and the
receiver's table (`slots.py`: `recv_act{h}`, `recv_grad{h}`) says which arrival is real and which
slot takes it; the others go to a trash slot. (Masking the sender per hop would only add selects:
the bytes moved are the same.) After the scan: the transposed layer exchange, and a psum over
`pipeline` of the final norm's gradient and the loss. No table-sized collective.

Engine (per rank, a `lax.scan` over the table's T steps, carry `Carry`). Each step: store the
received gradients (one per hop, and the head's for the last stage); embed stage 0's two
microbatches of this step (vocab-parallel lookup, every rank); run the cell's B or W (a
`lax.switch` over the slot plan's `back_branches`, one copy per distinct stage length so an
uneven split's shorter stages run only their own layers), recomputing the stage from its stashed
input with `jax.vjp`; pull stage 0's input gradient into the embedding shards (every rank); store the
received activations (after B/W, so a slot released this step takes one); run the F; if the last
stage ran F, every rank runs its share of the final norm + LM head + loss on that output and keeps
the output's gradient for the last stage's B (a `lax.cond` every rank takes alike); then the
ppermutes. Stage 0 and the last stage may sit on any rank (both on rank 0 in a V shape): what they
do differently is chosen by the table's per-step fields, not by rank. Slots come from `slots.py`:
a 1F1B rank holds at most min(m, 2(p - r) - 1) stashed inputs, GPipe m.

Everything with a collective over `pipeline` runs outside the per-rank branches: on XLA:CPU a
collective-permute (a ppermute, or one the partitioner inserts for a gather on a sharded table)
waits for every device, so ranks not taking the branch would deadlock. Keeping the embedding in
the engine makes its input tokens [m, mb, S+1], not activations, so only the stash grows with m.

MoE: router statistics are accumulated per microbatch beside the activations (`router.py`), so
the load-balancing and z losses equal the non-pipelined step's (per microbatch, averaged).

End stages that run more than layers (`stage.Ends`: DeepSeek-V3's leading dense layers on the
first, its multi-token prediction modules and their losses on the last) get their own branch
groups, chosen by the table's stage kind; their backward adds the gradients of the shared params
they read to the shared sums. A model without them compiles the branches it always had.

Proven equal to one device by `tests/parallel/pipeline/test_pipeline.py` (every schedule, uneven and auto splits,
with data, expert-as-data, tensor + SP, ZeRO-1/3, remat, tied embeddings),
`tests/parallel/pipeline/test_pipeline_stage_maps.py` (V-shaped stage maps: hops 0 and ±1, both ends on rank 0)
and `tests/parallel/pipeline/test_pipeline_moe.py` (Mixtral with expert, data and tensor axes), the end
stages' extra work by `tests/models/test_families_degeneracy.py` (DeepSeek-V3's `*_dense_mtp*` cases), with context
parallelism by `tests/parallel/test_context.py`; the slot plan by `tests/parallel/pipeline/test_pipeline_slots.py`;
the forward-only pass per target (`pipelined_target_logps`, DPO's log-probabilities) by `tests/train/test_dpo_pipeline.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.axes import PIPELINE
from jaxpar.manual import psum_wide, vary_everywhere, vary_everywhere_wide, vary_like
from jaxpar.parallel.context.sequence import TokenBatch, sequence_order
from jaxpar.parallel.pipeline import router
from jaxpar.parallel.pipeline.layout import from_stages, to_stages
from jaxpar.parallel.pipeline.shard import setup
from jaxpar.parallel.pipeline.slots import FIRST, LAST
from jaxpar.parallel.pipeline.stage import Ends, Stage, StageModel
from jaxpar.parallel.pipeline.vocab import head_loss, lookup, shard_offset
from jaxpar.parallel.tensor import cross_entropy, mean_cross_entropy
from jaxpar.parallel.zero import in_use
from jaxpar.sharding import RESIDUAL, is_logical_names


class Carry(NamedTuple):
    acts: jax.Array  # [K_a + 1, mb, S, D]: stage inputs waiting for F, stashed for B/W
    grads: jax.Array  # [K_g + 1, mb, S, D]: output gradients waiting for B (and W)
    in_act: tuple  # per hop, the activation delivered at the end of the previous step
    in_grad: tuple  # per hop, the gradient delivered
    in_head: jax.Array  # the head's gradient of the last stage's output, computed last step
    layer_grads: Any  # [v, Lmax, ...] fp32, this rank's stages
    shared_grads: Any  # embedding / head shards and final norm, fp32
    ce: jax.Array  # fp32 sum of the microbatches' cross-entropies (this replica's rows)
    aux: jax.Array  # fp32 sum of the microbatches' MoE aux losses (global)
    metrics: Any  # sums of the microbatches' MoE metrics ({} for dense models)
    stats: Any  # [m, ...] this rank's router statistics per microbatch, summed over its stages
    totals: Any  # [m, ...] per microbatch, summed over all stages and replicas (once known)
    mtp: Any = None  # fp32 [D] sums of the microbatches' multi-token prediction losses (None: none)


def _add(acc, delta):
    return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, delta)


def _zeros(tree, lead=(), dtype=jnp.float32):
    return jax.tree.map(lambda a: vary_everywhere(jnp.zeros(lead + tuple(a.shape), dtype)), tree)


def _engine(layers, shared, seq: TokenBatch, ahead, rank_tables, layout_tables, steps, scale, *, plan, layout,
            stage_model, opts, shared_names, batch_axes, vocab, ends: Ends, train=True, per_token=False):
    """`train=False`: the loss only (eval) — the table's F actions and the head, every B and W
    idle, no gradient carried; with `per_token`, every target's loss [m, mb, S] instead of their
    mean (the carry's `ce` holds them per microbatch). `ahead`: the microbatches' tokens ahead [m, D, mb, S] with
    multi-token prediction on the last stage (`ends`), else ()."""
    p, m = plan.schedule.num_ranks, plan.schedule.num_microbatches
    dtype, zero3 = opts.compute_dtype, opts.plan.zero.shard_params
    opts = dataclasses.replace(opts, rules=opts.rules.without(PIPELINE, *batch_axes).on(jax.sharding.get_abstract_mesh()))
    stage, rules = Stage(stage_model, opts), opts.rules
    # Every input is marked varying over all manual axes before any vjp: differentiating with
    # respect to a value replicated over `data` would psum its gradient over `data` right there.
    staged = jax.tree.map(vary_everywhere, to_stages(jax.tree.map(lambda a: a.astype(dtype), layers), layout_tables, layout))
    lengths = layout.lengths  # one branch per distinct stage length: padding never runs
    length_of = layout_tables["length"][0]  # [v]: this rank's virtual stages' index into `lengths`
    # ZeRO-3: embedding / head (and their gradient sums) are gathered over `data` for the whole
    # step: left data-sharded, XLA's SPMD partitioner aborts on them when tensor > 1. Layers are
    # still gathered one at a time inside the layer scan.
    shared_rules = in_use(rules) if zero3 else rules
    shared = jax.tree.map(
        lambda a, n: vary_everywhere(shared_rules.constrain(a.astype(dtype), n)), shared, shared_names,
        is_leaf=is_logical_names,
    )
    # Inputs and targets are split from the [S+1] rows outside (slicing them inside a branch can
    # make the partitioner emit a collective-permute there, which deadlocks ranks not taking it).
    # Every field is per microbatch [m, mb, S]: packed documents differ between microbatches.
    inputs = vary_everywhere(rules.constrain(seq.tokens, (None, "batch", None)))
    targets = vary_everywhere(rules.constrain(seq.targets, (None, "batch", None)))
    positions, segments = jax.tree.map(vary_everywhere, (seq.positions, seq.segment_ids))
    # Target weights stay invariant over `pipeline` (equal on every rank): the spread head's loss
    # is invariant there, and a varying factor would make its transpose psum the cotangent over
    # `pipeline` (gradients p times too large; tests/data/test_packed.py).
    weights = seq.weights

    def of_microbatch(mb):
        """(positions, segment ids | None) of microbatch mb, picked outside the branches."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, mb, keepdims=False), (positions, segments))

    def weights_of(mb):
        return None if weights is None else jax.lax.dynamic_index_in_dim(weights, mb, keepdims=False)

    depth = ends.prediction_depth
    ahead = jax.tree.map(vary_everywhere, ahead)

    def ahead_of(mb):
        """Microbatch mb's tokens ahead [D, mb, S] (None without prediction), picked outside the branches."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, mb, keepdims=False), ahead) if depth else None

    rows = {k: t[:, 0] for k, t in rank_tables.items()}
    replicas = jax.lax.psum(1, batch_axes) if batch_axes else 1
    act_shape = inputs.shape[1:] + (stage_model.hidden_size,)
    any_layer = jax.tree.map(lambda a: a[0], staged)  # merge needs *some* layers to build the model
    spread = vocab == "spread"
    offset = shard_offset(shared["embed"]["weight"].shape[0]) if spread else 0

    def zeros_act(lead=()):
        return vary_everywhere(rules.constrain(jnp.zeros(lead + act_shape, dtype), (None,) * len(lead) + RESIDUAL))

    def layer(u, n):
        """Virtual stage u's first n layers (n static: the branch's stage length)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u, keepdims=False)[:n], staged)

    def branch_of(base, u):  # base: the first of len(lengths) branches, one per stage length
        return base + jax.lax.dynamic_index_in_dim(length_of, u, keepdims=False)

    stats_shape = jax.eval_shape(lambda x: stage.forward(layer(0, 1), shared, x, *of_microbatch(0))[1], zeros_act())
    no_stats = _zeros(stats_shape)
    loss_cotangent = (scale / m).astype(jnp.float32)
    # Where the losses and metrics every rank computes alike ("spread" head, MoE totals) are
    # counted once; any rank would do, wherever the last stage sits.
    on_last_rank = jax.lax.axis_index(PIPELINE) == p - 1

    def head(sh, h, tgt, w):
        """Final norm + LM head + mean (weighted: packed documents) cross-entropy of the last
        stage's output h."""
        model = stage.model(any_layer, sh)
        if not spread:  # this rank holds the whole (tensor-sharded) head
            logits = model.logits_from_hidden(h, opts)
            return cross_entropy(logits, tgt) if per_token else mean_cross_entropy(logits, tgt, w)
        normed = model.final_norm(vary_everywhere_wide(h))  # the transpose sums every rank's share of d h
        return head_loss(normed, model.head_weight(), tgt, offset, stage_model.vocab_size, rules, w,
                         softcap=stage_model.logit_softcap, per_token=per_token)

    def count_ce(total, ce, mb):
        """The carry's `ce` with microbatch mb's loss added (per token: into its own row)."""
        return total.at[mb].add(ce) if per_token else total + ce

    # Branch groups by the kind of stage (`slots`: FIRST, LAST): None, any stage's layers; FIRST,
    # the first stage's with the model's blocks before them; LAST, the last stage's followed by
    # the head ("ends") and, training, multi-token prediction. Each group has one branch per stage
    # length; a group exists only where it differs from None's.
    fwd_roles = [None] + ([FIRST] if ends.first_layers else []) + ([] if spread else [LAST])
    back_roles = [None] + ([FIRST] if ends.first_layers else []) + ([LAST] if depth else [])
    # The multi-token prediction losses' cotangent: their mean's weight in the loss.
    mtp_grad = vary_everywhere(jnp.full((depth,), loss_cotangent * opts.mtp_loss_weight / max(depth, 1), jnp.float32))

    def group(roles, kind):
        """The index in `roles` of a stage of this kind (a traced table entry): 0 unless listed."""
        if len(roles) == 1:
            return 0
        if roles == [None, LAST]:  # "ends" alone: as written before the other groups existed
            return (kind == LAST).astype(jnp.int32)
        index = jnp.zeros((), jnp.int32)
        for i, role in enumerate(roles[1:], 1):
            index = jnp.where(kind == role, i, index)
        return index

    def forward_branch(n, role):
        first, with_head = role == FIRST, role == LAST
        predicting = with_head and depth > 0

        def run(x, tgt, w, mb_seq, mb_ahead, u, shared_grads, ce, mtp):
            if predicting:
                y, stats, losses = stage.forward_predicting(layer(u, n), shared, x, *mb_seq, mb_ahead)
                ce, mtp = ce + opts.mtp_loss_weight * jnp.mean(losses), mtp + losses
            else:
                y, stats = stage.forward(layer(u, n), shared, x, *mb_seq, first=first)
            y = rules.constrain(y, RESIDUAL)
            if not with_head:
                return y, stats, zeros_act(), shared_grads, ce, mtp
            # "ends": the last stage runs norm + head + loss on its output right away.
            if not train:
                return y, stats, zeros_act(), shared_grads, ce + vary_everywhere(head(shared, y, tgt, w)), mtp
            loss, pullback = jax.vjp(lambda sh, h: head(sh, h, tgt, w), shared, y)
            d_shared, d_h = pullback(vary_like(loss_cotangent, loss))
            d_h = rules.constrain(d_h.astype(dtype), RESIDUAL)
            return y, stats, d_h, _add(shared_grads, d_shared), ce + vary_everywhere(loss), mtp

        return run

    def idle_forward(x, tgt, w, mb_seq, mb_ahead, u, shared_grads, ce, mtp):
        return zeros_act(), no_stats, zeros_act(), shared_grads, ce, mtp

    # 0 idle, then per group g and stage length i: 1 + g·len + i.
    fwd_branches = [idle_forward] + [forward_branch(n, role) for role in fwd_roles for n in lengths]

    def backward_branch(branch, n, role):
        first, last = role == FIRST, role == LAST
        extras = ends.extras(first, last) if branch.params else ()

        def run(x, output_grad, stats_grad, mb_seq, mb_ahead, u, layer_grads, shared_grads):
            pos, seg = mb_seq
            d_layer, d_input, d_extra = stage.backward(
                branch, layer(u, n), shared, x, pos, output_grad, stats_grad, seg, first=first, extras=extras,
                ahead=mb_ahead if last else None, loss_grad=mtp_grad,
            )
            if d_layer is not None:
                layer_grads = jax.tree.map(lambda a, d: a.at[u, :n].add(d.astype(jnp.float32)), layer_grads, d_layer)
            if d_extra is not None:  # the end stage's shared params, summed over `pipeline` after the scan
                shared_grads = {**shared_grads, **{k: _add(shared_grads[k], d) for k, d in d_extra.items()}}
            d_input = zeros_act() if d_input is None else rules.constrain(d_input.astype(dtype), RESIDUAL)
            return d_input, layer_grads, shared_grads

        return run

    def idle_back(x, output_grad, stats_grad, mb_seq, mb_ahead, u, layer_grads, shared_grads):
        return zeros_act(), layer_grads, shared_grads

    # 0 idle, then per group g, slot-plan branch b (from 1) and stage length i: 1 + (g·(B - 1) + b - 1)·len + i.
    back_branches = [idle_back] + [
        backward_branch(b, n, role) for role in back_roles for b in plan.back_branches[1:] for n in lengths
    ]
    back_kinds = len(plan.back_branches) - 1
    hops, recv_fields = plan.hops, plan.recv_fields

    def send(value, hop, forward: bool):
        """`value` over one hop (`slots.py`): by +d forward, -d backward; d = 0 stays here."""
        if hop.distance == 0:
            return value
        perm = list(hop.pairs) if forward else [(b, a) for a, b in hop.pairs]
        return jax.lax.ppermute(value, PIPELINE, perm)

    def receive(buffer, arrivals, fields, row):
        for arrival, field in zip(arrivals, fields):
            buffer = jax.lax.dynamic_update_index_in_dim(buffer, arrival, row[field], 0)
        return buffer

    def head_step(c: Carry, y, is_last, mb):
        """After the last stage's F of microbatch `mb`, on every rank: the vocab-parallel head
        ("spread") and the microbatch's router totals (MoE)."""
        if spread:
            h = psum_wide(jnp.where(is_last, y, jnp.zeros_like(y)), PIPELINE)  # the last stage's output
            tgt, w = targets[mb], weights_of(mb)
            if not train:
                ce = head(shared, h, tgt, w)
                return c._replace(ce=count_ce(c.ce, jnp.where(on_last_rank, vary_everywhere(ce), 0.0), mb))
            ce, pullback = jax.vjp(lambda sh, hh: head(sh, hh, tgt, w), shared, h)
            d_shared, d_h = pullback(vary_like(loss_cotangent, ce))
            c = c._replace(
                in_head=vary_everywhere(rules.constrain(d_h.astype(dtype), RESIDUAL)),
                shared_grads=_add(c.shared_grads, d_shared),
                ce=c.ce + jnp.where(on_last_rank, vary_everywhere(ce), 0.0),
            )
        if not c.stats:
            return c
        totals = jax.lax.psum(jax.tree.map(lambda a: a[mb], c.stats), (PIPELINE, *batch_axes))
        extra, metrics = router.loss_and_metrics(stage_model, totals)
        count = lambda a, b: a + jnp.where(on_last_rank, vary_everywhere(b), 0.0)  # noqa: E731
        return c._replace(
            aux=count(c.aux, extra),
            metrics=jax.tree.map(count, c.metrics, metrics),
            totals=jax.tree.map(lambda a, t: a.at[mb].set(vary_everywhere(t)), c.totals, totals),
        )

    def forward_part(carry: Carry, row, step, first_input, shared_grads):
        """This step's F (and, after the last stage's, the head), then the router statistics;
        returns the carry and the F's output. `first_input`: stage 0's embedded microbatch."""
        # After B/W: a slot it released this step may take this step's arrival.
        acts = receive(carry.acts, carry.in_act, [a for a, _ in recv_fields], row)
        x = jnp.where(row["fwd_kind"] == FIRST, first_input, acts[row["fwd_slot"]])
        is_last = row["fwd_kind"] == LAST
        with_head = group(fwd_roles, row["fwd_kind"]) * len(lengths)
        branch = jnp.where(row["fwd_branch"] == 0, 0, branch_of(1 + with_head, row["fwd_stage"]))
        mb = row["fwd_mb"]
        y, stats, d_head, shared_grads, ce, mtp = jax.lax.switch(
            branch, fwd_branches, x, targets[mb], weights_of(mb), of_microbatch(mb), ahead_of(mb), row["fwd_stage"],
            shared_grads, carry.ce[mb] if per_token else carry.ce, carry.mtp,
        )
        ce = carry.ce.at[mb].set(ce) if per_token else ce  # "ends": the branch added to microbatch mb's row
        carry = carry._replace(acts=acts, shared_grads=shared_grads, ce=ce, in_head=d_head, mtp=mtp)
        if train:
            carry = carry._replace(stats=jax.tree.map(lambda a, s: a.at[mb].add(s), carry.stats, stats))
        if spread or (carry.stats and train):  # every rank takes this cond alike (a per-step table entry)
            step_fn = functools.partial(head_step, y=y, is_last=is_last, mb=step["head_mb"])
            carry = jax.lax.cond(step["has_head"] > 0, step_fn, lambda c: c, carry)
        return carry, y

    def time_step(carry: Carry, xs):
        row, step = xs
        with jax.named_scope("pipeline_step"):
            grads = receive(carry.grads, carry.in_grad, [g for _, g in recv_fields], row)
            grads = jax.lax.dynamic_update_index_in_dim(grads, carry.in_head, row["recv_head"], 0)
            # Stage 0's inputs for this step's F and B/W (used by its rank only). "spread": every
            # rank looks up the tokens it holds rows for, one psum completes both.
            table = shared["embed"]["weight"]
            part_fwd = lookup(table, inputs[step["embed_fwd_mb"]], offset, stage_model.embed_scale)
            part_back, embed_pullback = jax.vjp(lambda t: lookup(t, inputs[step["embed_back_mb"]], offset, stage_model.embed_scale), table)
            embedded = jnp.stack([part_fwd, part_back])
            embedded = psum_wide(embedded, PIPELINE) if spread else embedded
            embedded = vary_everywhere(rules.constrain(embedded, (None,) + RESIDUAL))
            back_on_first = row["back_kind"] == FIRST
            x = jnp.where(back_on_first, embedded[1], carry.acts[row["back_slot"]])
            totals = jax.tree.map(lambda a: a[row["back_mb"]], carry.totals)
            stats_grad = jax.tree.map(
                lambda g: vary_everywhere(g * (replicas * loss_cotangent)), router.totals_grad(stage_model, totals)
            )
            back = row["back_branch"]
            back_group = group(back_roles, row["back_kind"]) * back_kinds
            back = jnp.where(back == 0, 0, branch_of(1 + (back_group + back - 1) * len(lengths), row["back_stage"]))
            # The shared gradients pass through the branches only where an end stage adds to them.
            ends_grads = carry.shared_grads if len(back_roles) > 1 else None
            d_input, layer_grads, ends_grads = jax.lax.switch(
                back, back_branches, x, grads[row["back_grad_slot"]], stats_grad, of_microbatch(row["back_mb"]),
                ahead_of(row["back_mb"]), row["back_stage"], carry.layer_grads, ends_grads,
            )
            zero = jnp.zeros_like(d_input)
            send_grad = jnp.where(back_on_first, zero, d_input)
            # Stage 0's input gradient into the embedding: "spread": psummed to every rank, each
            # scatters it into its own rows; "ends": stage 0's rank's, summed over ranks after the scan.
            d_embedded = jnp.where(back_on_first, d_input, zero)
            d_embedded = psum_wide(d_embedded, PIPELINE) if spread else d_embedded
            (d_table,) = embed_pullback(vary_everywhere(d_embedded))
            shared_grads = dict(carry.shared_grads if ends_grads is None else ends_grads)
            shared_grads["embed"] = {"weight": shared_grads["embed"]["weight"] + d_table.astype(jnp.float32)}
            carry, y = forward_part(carry._replace(grads=grads, layer_grads=layer_grads), row, step, embedded[0],
                                    shared_grads)
            return carry._replace(
                in_act=tuple(send(y, hop, True) for hop in hops),
                in_grad=tuple(send(send_grad, hop, False) for hop in hops),
            ), None

    def eval_step(carry: Carry, xs):
        """`time_step` without B/W: the F of the table's step, its stage-0 lookup and the head."""
        row, step = xs
        with jax.named_scope("pipeline_eval_step"):
            embedded = lookup(shared["embed"]["weight"], inputs[step["embed_fwd_mb"]], offset, stage_model.embed_scale)
            embedded = psum_wide(embedded, PIPELINE) if spread else embedded
            embedded = vary_everywhere(rules.constrain(embedded, RESIDUAL))
            carry, y = forward_part(carry, row, step, embedded, None)
            return carry._replace(in_act=tuple(send(y, hop, True) for hop in hops)), None

    if not train:
        start = Carry(
            acts=zeros_act((plan.act_slots + 1,)), grads=None, in_act=tuple(zeros_act() for _ in hops), in_grad=(),
            in_head=zeros_act(), layer_grads=None, shared_grads=None,
            ce=vary_everywhere(jnp.zeros(inputs.shape if per_token else (), jnp.float32)),
            aux=None, metrics=None, stats=_zeros(stats_shape, (m,)), totals=None,
        )
        end, _ = jax.lax.scan(eval_step, start, (rows, steps))
        if per_token:  # counted on the last stage's rank ("ends") or the last rank ("spread"): zeros elsewhere
            return jax.lax.psum(end.ce, PIPELINE)
        return jax.lax.psum(end.ce, (PIPELINE, *batch_axes)) / (m * replicas)

    start = Carry(
        acts=zeros_act((plan.act_slots + 1,)),
        grads=zeros_act((plan.grad_slots + 1,)),
        in_act=tuple(zeros_act() for _ in hops),
        in_grad=tuple(zeros_act() for _ in hops),
        in_head=zeros_act(),
        layer_grads=_zeros(staged),
        shared_grads=jax.tree.map(
            lambda z, n: shared_rules.constrain(z, n), _zeros(shared), shared_names, is_leaf=is_logical_names
        ),
        ce=vary_everywhere(jnp.zeros((), jnp.float32)),
        aux=vary_everywhere(jnp.zeros((), jnp.float32)),
        metrics=_zeros(router.zero_metrics(stage_model, stats_shape)),
        stats=_zeros(stats_shape, (m,)),
        totals=_zeros(stats_shape, (m,)),
        mtp=vary_everywhere(jnp.zeros((depth,), jnp.float32)) if depth else None,
    )
    end, _ = jax.lax.scan(time_step, start, (rows, steps))

    layer_grads = from_stages(end.layer_grads, _zeros(layers), layout_tables, layout)
    if not layout.sharded:  # storage replicated over `pipeline`: each rank has its stages' share
        layer_grads = jax.lax.psum(layer_grads, PIPELINE)
    shared_grads = jax.tree.map(  # "spread": the tables are this rank's own shard; the rest are shares
        lambda g, n: shared_rules.constrain(g if spread and "vocab" in n else jax.lax.psum(g, PIPELINE), n),
        end.shared_grads, shared_names, is_leaf=is_logical_names,
    )
    # Losses and metrics are counted on one rank per replica (with "ends", the loss on the last
    # stage's rank): sum them and divide.
    everyone = (PIPELINE, *batch_axes)
    loss = jax.lax.psum(end.ce + end.aux, everyone) / (m * replicas)
    metrics = jax.tree.map(lambda a: jax.lax.psum(a, everyone) / (m * replicas), end.metrics)
    if depth:  # each depth's loss, averaged like the loss (`jaxpar.train.loss`)
        metrics = {**metrics, "mtp_loss": jax.lax.psum(end.mtp, everyone) / (m * replicas)}
    lead = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
    return loss, lead(layer_grads), lead(shared_grads), metrics


def pipelined_loss_and_grads(params, batch, *, model: StageModel, opts, scale=1.0):
    """Same contract as `jaxpar.train.step.loss_and_grads`: (loss, fp32 unscaled grads, metrics),
    computed by the pipeline engine with the plan's pipeline options (microbatches replace
    `train.grad_accum`). `model`: the model as the pipeline sees it, from the train step."""
    rules, logical = opts.rules, model.logical
    run, args, batch_axes = setup(_engine, params, batch, model, opts, train=True)
    loss, layer_grads, shared_grads, metrics = run(*args, jnp.asarray(scale, jnp.float32))
    # Sum over the per-replica axis, divided by the replica count: a mean, except for expert
    # weights, whose entries are already sums over their expert group (the dispatch's transpose).
    replicas = 1
    for axis in batch_axes:
        replicas *= rules.mesh.shape[axis]
    shared_names = {k: n for k, n in logical.items() if k != "layers"}
    reduce = lambda g, n: rules.constrain(jnp.sum(g, axis=0) / replicas, n)  # noqa: E731
    layer_grads = jax.tree.map(reduce, layer_grads, logical["layers"], is_leaf=is_logical_names)
    shared_grads = jax.tree.map(reduce, shared_grads, shared_names, is_leaf=is_logical_names)
    grads = jax.tree.map(lambda g: g / scale, {**shared_grads, "layers": layer_grads})
    return loss, grads, metrics


def pipelined_loss(params, batch, *, model: StageModel, opts):
    """The mean next-token loss over the batch's real targets (no auxiliary losses), computed by
    the engine without gradients: the table's F actions and the head only (eval)."""
    run, args, _ = setup(_engine, params, batch, model, opts, train=False)
    return run(*args, jnp.asarray(1.0, jnp.float32))


def pipelined_target_logps(params, rows, *, model: StageModel, opts):
    """log p of every next-token target [G, S] fp32 in text order (`rows`: a `document_batch`
    dict), forward only as `pipelined_loss` runs, per token: DPO's sequence sums (`jaxpar.train.dpo`)."""
    run, args, _ = setup(_engine, jax.lax.stop_gradient(params), rows, model, opts, train=False, per_token=True)
    logps = -run(*args, jnp.asarray(1.0, jnp.float32))  # [m, mb, S] in the plan's sequence order
    order = sequence_order(opts.plan.context, logps.shape[-1])
    logps = logps if order is None else logps[..., np.argsort(order)]
    return logps.swapaxes(0, 1).reshape(-1, logps.shape[-1])  # microbatch k holds rows j·m + k
