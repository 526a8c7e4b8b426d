"""The collectives jaxpar's training step causes, per step and mesh axis, analytically.

Byte convention (shared with the compiled-HLO side, `jaxpar.analysis.program.compiled`): every
collective has a *size*, the full buffer it moves per device —
  all-reduce, all-to-all, collective-permute: the buffer;
  all-gather: the gathered result;   reduce-scatter: the operand before scattering —
and its *wire bytes* are what one participating device sends with bandwidth-optimal ring
algorithms over a group of n: all-reduce 2(n-1)/n · size, all-gather / reduce-scatter /
all-to-all (n-1)/n · size, collective-permute size (a sender sends its buffer once). Time on a
link is wire bytes / the link's unidirectional per-device bandwidth.

What each parallelism causes (D hidden, a = tokens · D activation bytes per step on one device):
Compute-dtype values move in the compute dtype (`Layout.activation_bytes`: fp32 on XLA:CPU).

- tensor (Megatron, `jaxpar.sharding` rules): per layer, forward 2 all-reduces of a (attention
  and MLP outputs, row-parallel), backward 2 (their inputs' gradients); remat full recomputes the
  attention one (the recompute skips the MLP's down projection). The vocab-parallel embedding
  all-reduces a once; the LM head's input gradient
  (fp32) once; the loss reduces three [tokens] fp32 vectors. With sequence parallelism each
  all-reduce becomes an all-gather + reduce-scatter pair of the same a.
- data / expert-as-data (batch axes): gradients all-reduced over the batch axes once per step
  (per-replica / per-rank accumulation) or once per microbatch (MoE, ZeRO-3: plain accumulation). ZeRO-1:
  reduce-scatter of the gradients over data, then all-gather of the updated parameters (param
  dtype); over data x context (`parallel.zero_axes`) `jaxpar.analysis.cost.comm_zero`; the
  embedding's gradient instead moves its cotangent activations by all-to-all (and
  the token ids by all-gather). ZeRO-3: each layer's weights all-gathered (compute dtype) inside
  the layer scan and again in the backward (three times in a pipeline stage, whose backward
  re-runs its forward), and each layer's gradient reduce-scattered, per microbatch; the LM head
  is gathered once and its gradient reduce-scattered; the embedding
  lookup all-to-alls its activations (and all-gathers token ids) forward and backward.
- expert (`jaxpar.parallel.expert`): per MoE layer, forward two all-to-alls of the dispatch
  buffer (tokens · rows-per-token · D; dropless buffers are worst-case sized) plus one of the
  per-expert counts, backward two more; remat full / save_dots recompute the forward ones. Expert
  weight gradients are all-reduced over data; everything else over data and expert.
- pipeline (`jaxpar.parallel.pipeline`): per time step of the schedule table, two
  collective-permutes of one microbatch's activations [mb, S, D] (forward activations, backward
  gradients). Vocab tables "spread" over pipeline (the default): per time step two all-reduces
  over pipeline (the step's embeddings, stage 0's input gradient), per microbatch two of the
  head's input and its gradient plus the loss vectors (`_spread_vocab`); "ends": after the
  engine the shared (embedding / head / norm) gradients are all-reduced over pipeline. Then all
  gradients over the batch axes once.
- context (`jaxpar.analysis.cost.comm_context`): per layer the K/V exchange of
  `parallel.context_impl` (all-gathers + reduce-scatters, ring permutes, or Ulysses all-to-alls);
  gradients all-reduced over context like over the batch axes (a separate all-reduce on XLA:CPU;
  with the batch axes in one all-reduce once per step under per-rank accumulation and after the
  pipeline engine; MoE expert weights' with the data one, per microbatch).

`XlaLowering` says how the compiler turns the sharding into collectives. `IDEAL` is the
Megatron/ZeRO count above: XLA's GPU compiler runs ReduceScatterCreator and AllReduceReassociate
in its "collective-optimizations" pipeline (xla/service/gpu/gpu_compiler.cc), which turn
all-reduce + dynamic-slice into reduce-scatter and sum partial all-reduces first; not yet checked
on a GPU in this project.
`XLA_CPU` is what XLA:CPU emits, measured on 8 emulated devices: partitioner-made
reduce-scatters stay all-reduce + dynamic-slice, the backward's per-projection partial input
gradients are all-reduced separately (q, k, v: 3; gate, up: 2) instead of summed first, and with
sequence parallelism each backward use of a gathered output gradient gathers it again (4, not 2).
Known inefficiencies of jaxpar found by comparing with compiled HLO are priced too, in
`jaxpar_quirks` and where they arise (`Planned.quirk`; each says what it is): they are what
jaxpar does today. `Planned`, `wire_bytes` and the lowerings live in `jaxpar.analysis.cost.planned`.
"""

from __future__ import annotations

from jaxpar.analysis.cost.comm_context import (  # noqa: F401 (context_collectives: re-exported)
    context_collectives,
    context_gradients,
    context_reduced_with_data,
    dispatch_manual_over_context,
)
from jaxpar.analysis.cost.comm_tensor import scatter_kind, tensor_collectives, tp_layers
from jaxpar.analysis.cost.comm_zero import spans_context, zero1, zero3_embedding, zero3_gathers
from jaxpar.analysis.cost.layout import CONTEXT, DATA, EXPERT, PIPELINE, TENSOR, Layout
from jaxpar.analysis.cost.memory import ParamCounts, moe_rows_per_token, param_counts
from jaxpar.analysis.cost.optimizer_terms import optimizer_collectives
from jaxpar.analysis.cost.planned import (  # noqa: F401 (wire_bytes, XlaLowering, IDEAL, XLA_CPU: re-exported)
    IDEAL,
    XLA_CPU,
    Planned,
    XlaLowering,
    lowering_for,
    present_axes,
    wire_bytes,
)
from jaxpar.analysis.program.hlo import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE
from jaxpar.parallel.data import GradientStrategy


def _reductions_per_step(layout: Layout) -> int:
    """How often gradients are reduced over the batch axes per step: once with per-replica or
    per-rank accumulation (dense, ZeRO 0/1) or the pipeline engine, else per microbatch."""
    return layout.microbatches if layout.gradient is GradientStrategy.PLAIN else 1


def _expert_grads_apart(layout: Layout) -> bool:
    """Whether the expert weights' gradients are reduced apart from the rest: they are summed by
    the dispatch shard_map's transpose over its manual axes other than expert (they live on one
    expert rank), `_expert_grad_axes`, while the partitioner reduces the others."""
    return layout.is_moe and (layout.e > 1 or dispatch_manual_over_context(layout))


def _expert_grad_axes(layout: Layout) -> tuple[str, ...]:
    """Data, and with a dropless dispatch context too: one all-reduce over both (measured, Mixtral
    8x7B data 2/4 x context 2, expert 1 and 2, ZeRO 0/1/3, and at test size)."""
    # After the pipeline engine, manual over context, the same (measured, Mixtral 8x7B pipeline 2
    # x context 2 x expert 2).
    over_context = dispatch_manual_over_context(layout) or context_reduced_with_data(layout)
    return present_axes(layout, DATA, CONTEXT) if over_context else present_axes(layout, DATA)


def data_collectives(layout: Layout, counts: ParamCounts) -> list[Planned]:
    batch = layout.batch_axes
    if context_reduced_with_data(layout):
        batch = present_axes(layout, DATA, CONTEXT, EXPERT)
    apart = _expert_grads_apart(layout)
    if not batch and not apart:
        return []
    out = []
    k = _reductions_per_step(layout)
    grads = 4 * counts.as_params
    expert_grads = 4 * counts.experts * layout.layers_per_device if apart else 0
    if apart:
        # Whatever the ZeRO stage (ZeRO-3's data split of the expert weights is sliced after the
        # sum): one all-reduce per MoE layer and microbatch.
        axes = _expert_grad_axes(layout)
        # ZeRO-3 slices its data shard out of the sum: a reduce-scatter where it is over data alone.
        kind = scatter_kind(layout) if layout.zero.shard_params and axes == (DATA,) else ALL_REDUCE
        if axes:
            out.append(Planned(kind, axes, expert_grads, k, "DP: expert weight gradients (dispatch transpose)"))
        grads -= expert_grads
    if not batch:
        return out
    if not layout.zero.shard_optimizer_state:
        out.append(Planned(ALL_REDUCE, batch, grads, k, "DP: gradient all-reduce"))
        extra = layout.facts.table_uses - 1
        if extra and lowering_for(layout).table_grads_per_use:  # measured: MTP, data 2 x expert 4
            tables = 4 * (counts.embedding + counts.head)
            out.append(Planned(ALL_REDUCE, batch, tables, k * extra, "DP: table gradients of each further use, apart"))
        return out
    if spans_context(layout) and layout.zero.gathers_updated_params:  # ZeRO-1 over data x context
        reduced = context_reduced_with_data(layout)
        if reduced:
            out.append(Planned(scatter_kind(layout), batch, grads, k, "ZeRO-1: gradient reduce-scatter"))
        return out + zero1(layout, counts, grads, k, reduced)
    # ZeRO over `data`: an expert axis (dense model) stays a plain all-reduce.
    data, zero_axes = present_axes(layout, DATA), batch
    # Per-replica accumulation reduces the table's gradient with the rest (measured: zero1
    # accum2), and so does a vocab-parallel table (tensor > 1: measured, data 2 x tensor 4).
    by_all_to_all = k == 1 and layout.microbatches == 1 and layout.t == 1 and layout.c == 1
    embed_bytes = 4 * counts.embedding if by_all_to_all else 0
    if layout.zero.gathers_updated_params:
        # After the pipeline engine the per-replica gradients are summed over all the batch axes
        # at once (measured, Mixtral 8x7B data 2 x pipeline 2 x expert 2).
        if layout.is_moe and layout.e > 1 and layout.p == 1:
            # Reduce-scattered over data, then the data shard all-reduced over expert, and over
            # context in the same all-reduce (measured, MoE data 2 x expert 4; Mixtral 8x7B data 2
            # x context 2 x expert 2).
            zero_axes = data
            # With context the embedding's shard is summed over each axis apart (measured, ibid.).
            table = 4 * counts.embedding if layout.c > 1 else 0
            out.append(Planned(ALL_REDUCE, present_axes(layout, CONTEXT, EXPERT), (grads - embed_bytes - table) / layout.d, k,
                               "ZeRO-1 MoE: shards over expert"))
            if table:
                out += [
                    Planned(ALL_REDUCE, (EXPERT,), table / layout.d, k, "ZeRO-1 MoE: embedding shard over expert"),
                    Planned(ALL_REDUCE, (CONTEXT,), table / layout.d, k, "ZeRO-1 MoE: embedding shard over context"),
                ]
            if layout.p == 1 and not by_all_to_all:
                out.append(_embedding_cotangent_replicated(layout))
        out += [
            Planned(scatter_kind(layout), zero_axes, grads - embed_bytes, k, "ZeRO-1: gradient reduce-scatter"),
            Planned(ALL_GATHER, data, layout.param_bytes * (counts.as_params - counts.embedding), 1, "ZeRO-1: updated parameters"),
            Planned(ALL_GATHER, data, layout.param_bytes * counts.embedding, 1, "ZeRO-1: updated embedding"),
        ]
        if by_all_to_all:
            out += _embedding_by_all_to_all(layout, zero_axes, forward=False)
        return out
    # ZeRO-3: per layer inside the scan, per microbatch: gathered for the forward and again for
    # the backward whatever the remat policy (`zero.layer_remat_policy`); a pipeline stage's
    # backward re-runs its forward first, a third gather (measured, data 2 x pipeline 4).
    L, m, cb = layout.layers_per_device, layout.microbatches, layout.activation_bytes
    gathers = 3 if layout.p > 1 else 2
    layer = counts.layer_gathered  # experts included: ZeRO-3 splits their embed dim too (measured, MoE data 8)
    # Layer gradients are reduce-scattered over data; the expert weights' are the dispatch's
    # all-reduce above when apart. With experts on their own axis the rest are all-reduced over
    # data x expert (measured, MoE data 2 x expert 4), else reduce-scattered over data.
    spanned = spans_context(layout)  # over data x context: `comm_zero`
    if spanned:
        out += zero3_gathers(layout, counts, gathers)
    else:
        out.append(Planned(ALL_GATHER, data, cb * layer, L * m * gathers, "ZeRO-3: layer weights (fwd and bwd)", overlap=True))
        out.append(Planned(ALL_GATHER, data, cb * counts.head, m, "ZeRO-3: LM head weights"))
    if not (layout.is_moe and layout.e > 1):
        scattered = layer - (counts.experts if apart else 0)
        out.append(Planned(scatter_kind(layout), data, 4 * scattered, L * m, "ZeRO-3: layer gradients", overlap=True))
    if not (spanned and layout.is_moe and layout.e > 1):
        out.append(Planned(scatter_kind(layout), data, 4 * counts.head, m, "ZeRO-3: LM head gradient"))
    if layout.e > 1 and not layout.is_moe:
        out.append(Planned(ALL_REDUCE, present_axes(layout, EXPERT), grads, k, "DP over expert axis: gradients"))
    if layout.is_moe and layout.e > 1:
        out.append(Planned(ALL_REDUCE, present_axes(layout, DATA, EXPERT), 4 * (layer - counts.experts), L * m,
                           "ZeRO-3 MoE: other layer gradients", overlap=True))
        if not spanned:
            out.append(_embedding_cotangent_replicated(layout))
    if spanned:
        return out + zero3_embedding(layout, counts)
    if layout.t == 1 and layout.e == 1:
        out += _embedding_by_all_to_all(layout, data, forward=True)
    else:  # the vocab-parallel table is gathered over data like a layer (measured, data 2 x tensor 4)
        out += [
            Planned(ALL_GATHER, data, cb * counts.embedding, m, "ZeRO-3: embedding table"),
            Planned(scatter_kind(layout), data, 4 * counts.embedding, m, "ZeRO-3: embedding gradient"),
        ]
    return out


def _embedding_cotangent_replicated(layout: Layout) -> Planned:
    """MoE with experts on their own axis under ZeRO-1 or 3: for the table's gradient (scatter-add,
    then its ZeRO split) the partitioner replicates each microbatch's output cotangent [rows,
    S/c, D] over data x expert ("Involuntary full rematerialization" in its log): an all-gather
    per microbatch (measured, Mixtral 8x7B data 2/4 x expert 2/4 with tensor and context, ZeRO 1
    and 3, and at test size). A jaxpar layout the partitioner handles badly, priced as it is."""
    rows = layout.tokens / layout.microbatches * layout.d * layout.e
    return Planned(ALL_GATHER, present_axes(layout, DATA, EXPERT), rows * layout.hidden * 4, layout.microbatches,
                   "ZeRO MoE: embedding cotangent replicated", True)


def _embedding_by_all_to_all(layout: Layout, axes, *, forward: bool) -> list[Planned]:
    """With the table sharded over data along its hidden dim (ZeRO-3), or its gradient wanted so
    (ZeRO-1), the partitioner moves activations [tokens, D] by all-to-all instead of moving the
    table, and all-gathers the token ids it needs."""
    act = layout.tokens * layout.hidden * (layout.activation_bytes if forward else 4)
    ids = layout.global_batch // layout.e * layout.seq * 4
    out = [
        Planned(ALL_GATHER, axes, ids, 1, "ZeRO: token ids for the embedding"),
        Planned(ALL_TO_ALL, axes, layout.tokens * layout.hidden * 4, 1, "ZeRO: embedding gradient by all-to-all"),
    ]
    if forward:
        out.append(Planned(ALL_TO_ALL, axes, act, 1, "ZeRO-3: embedding lookup by all-to-all"))
    return out


# ---- expert ------------------------------------------------------------------------------------


def expert_collectives(layout: Layout) -> list[Planned]:
    if not layout.is_moe or layout.e == 1:
        return []
    # Routing layers only (dense layers among MoE layers exchange nothing).
    axes, L = (EXPERT,), layout.layers_per_device * layout.facts.moe.layer_share
    buffer = layout.tokens * moe_rows_per_token(layout) * layout.hidden * layout.activation_bytes
    fwd_passes = 1 if layout.remat == "none" else 2  # the exchange is not a dot: save_dots recomputes it
    if layout.p > 1:
        # A pipeline stage's B re-runs F's forward before its backward, whose remat runs it again
        # (measured, Mixtral 8x7B pipeline 2/4 x expert 2/4, remat full: 8 per layer, not 6).
        fwd_passes += 1
    counts = layout.e * (layout.experts // layout.e) * 4
    # parallel.expert_overlap: each exchange in k independent chunks of 1/k the rows, which XLA may run
    # behind the other chunks' expert matmuls (`jaxpar.parallel.expert._in_chunks`).
    k = layout.plan.expert_chunks
    return [
        Planned(ALL_TO_ALL, axes, buffer / k, 2 * L * fwd_passes * k, "EP: dispatch and return (fwd)", k > 1),
        Planned(ALL_TO_ALL, axes, buffer / k, 2 * L * k, "EP: dispatch and return (bwd)", k > 1),
        Planned(ALL_TO_ALL, axes, counts, L * fwd_passes * layout.microbatches * k, "EP: per-expert counts"),
    ]


# ---- pipeline -----------------------------------------------------------------------------------


def pipeline_collectives(layout: Layout, counts: ParamCounts) -> list[Planned]:
    """Per time step two permutes of a microbatch's activations (SP-split with sequence
    parallelism); the vocab tables as `layout.pipeline_vocab` places them (`_spread_vocab`, or
    "ends": the shared gradients summed over pipeline after the engine); and, with tensor > 1,
    the stage layers' TP collectives, run twice per microbatch (F, and B's recompute)."""
    if layout.p == 1:
        return []

    steps = layout.pipeline_shape.num_steps
    mb_tokens = layout.tokens / layout.microbatches
    mb_full = mb_tokens * layout.hidden * layout.activation_bytes
    mb_act = mb_full / layout.t if layout.sequence_parallel else mb_full  # stage boundaries carry SP shards
    out = [Planned(COLLECTIVE_PERMUTE, (PIPELINE,), mb_act, 2 * steps, "PP: activations and gradients per time step")]
    # ZeRO-3 leaves the batch axes to the partitioner: the engine's loss scalars are summed over
    # its manual axes and tensor (measured, Llama 3 70B data 2 x pipeline 2 x tensor 2 / context 2).
    everyone = (present_axes(layout, PIPELINE, CONTEXT, TENSOR) if layout.zero.shard_params
                else present_axes(layout, DATA, PIPELINE, CONTEXT, EXPERT))
    out.append(Planned(ALL_REDUCE, everyone, 4, 1, "PP: the loss over pipeline and replicas"))
    if layout.vocab_spread:
        out += _spread_vocab(layout, counts, steps, mb_tokens, mb_full, mb_act)
    else:
        out.append(Planned(ALL_REDUCE, (PIPELINE,), 4 * counts.shared_gathered, 1, "PP: shared (embedding / head / norm) gradients"))
        if layout.t > 1:
            out.append(Planned(ALL_REDUCE, (TENSOR,), mb_act, 2 * steps, "PP+TP: embedding lookups each step"))
    if layout.t > 1:
        # Inside every stage action the layers' TP collectives run on microbatches: F runs the
        # chunk forward, B recomputes it and runs the backward (so forwards count twice). That
        # is a non-last rank's count, the busiest: with "ends" the last one skips F and adds the
        # head's exchanges (measured, pipeline 2 x tensor 4, per rank from the schedule's branch runs).
        act = layout.tokens * layout.hidden * layout.activation_bytes
        out += tp_layers(layout, act, 2, "PP+TP")
    return out


def _spread_vocab(layout: Layout, counts: ParamCounts, steps: float, mb_tokens: float, mb_full: float, mb_act: float) -> list[Planned]:
    """"spread" (`pipeline/vocab.py`, measured: data 2 x pipeline 4, and pipeline 2 x tensor 4 with
    and without SP, on the busiest rank): every time step, outside the stage branches, one
    all-reduce over pipeline completes the two embeddings of the step (F's and B's input, [2, mb,
    S, D]) and one sums stage 0's input gradient into every rank's table shard; per microbatch
    (the head cond) the last stage's output and its gradient are all-reduced over pipeline, and
    the loss's log-normaliser parts and label logit ([mb, S] fp32: max, sum, label). Only the
    final norm's gradient is summed over pipeline after the engine. With tensor > 1 the
    partitioner reduces each lookup over tensor (or, at small shapes, gathers the table once
    instead: measured at vocab 512, 6% less tensor traffic than priced), the head's input gradient
    (fp32) and four [mb, S] loss vectors; with SP it gathers the head's input sequence, and each
    step the input gradient's sequence for the table's scatter, and the token ids."""
    per_token = mb_tokens * 4  # one fp32 [mb, S] vector
    m = layout.microbatches
    norm = counts.shared_gathered - counts.embedding - counts.head
    out = [
        Planned(ALL_REDUCE, (PIPELINE,), 2 * mb_act, steps, "PP vocab: the step's two embeddings"),
        Planned(ALL_REDUCE, (PIPELINE,), mb_act, steps, "PP vocab: stage 0's input gradient to every table shard"),
        Planned(ALL_REDUCE, (PIPELINE,), mb_act, 2 * m, "PP vocab: last stage's output and its gradient"),
        Planned(ALL_REDUCE, (PIPELINE,), per_token, 3 * m, "PP vocab: loss (max, sum, label logit)"),
        Planned(ALL_REDUCE, (PIPELINE,), 4 * norm, 1, "PP: final norm gradient"),
    ]
    if layout.t > 1:
        out += [
            Planned(ALL_REDUCE, (TENSOR,), 2 * mb_full, steps, "PP vocab+TP: the step's lookups"),
            Planned(ALL_REDUCE, (TENSOR,), mb_tokens * layout.hidden * 4, m, "PP vocab+TP: head input gradient (fp32)"),
            Planned(ALL_REDUCE, (TENSOR,), per_token, 4 * m, "PP vocab+TP: loss vectors"),
        ]
        if layout.sequence_parallel and layout.zero.shard_params and layout.d > 1:
            # The partitioner re-lays the SP-split [mb, S/t, D] values between the rows' data
            # split and the ZeRO-3 table's by a permute over data x tensor each step: stage 0's
            # input gradient for the table's scatter-add, and, where that is cheaper than moving
            # the table shard (vocab 128256), both embedding lookups too (measured: 1 per step
            # at vocab 512, 3 at Llama 3 70B data 2 x pipeline 2 x tensor 2). Each with its ids.
            table_shard = layout.vocab * layout.hidden * 4 / (layout.vocab_shards * layout.d)
            moves = 3 if mb_act < table_shard else 1
            out.append(Planned(COLLECTIVE_PERMUTE, (DATA, TENSOR), mb_act + mb_tokens / layout.t * 4, moves * steps,
                               "PP vocab+SP ZeRO-3: lookups re-laid over data x tensor"))
        if layout.sequence_parallel:
            out += [
                Planned(ALL_GATHER, (TENSOR,), mb_full, m, "PP vocab+SP: the head's input sequence"),
                Planned(ALL_GATHER, (TENSOR,), mb_full, steps, "PP vocab+SP: input gradient sequence for the table"),
                Planned(ALL_GATHER, (TENSOR,), mb_tokens, steps, "PP vocab+SP: token ids"),
            ]
    return out


# ---- jaxpar's known inefficiencies -------------------------------------------------------------


def jaxpar_quirks(layout: Layout, counts: ParamCounts) -> list[Planned]:
    """Collectives jaxpar causes today beyond the design, found in compiled HLO (see the report
    in tests/analysis/test_analysis.py): each is a candidate fix in jaxpar."""
    out = []
    if layout.relays_layers:
        # Interleaved and V schedules on natural-order storage (none with the stack stored in the
        # schedule's order, `Layout.relays_layers`): the [L] layer stack is stored split contiguously over pipeline,
        # but rank r runs chunks r, r + p, ...: every step the partitioner moves the rank's
        # layer parameters into stage order, and their gradients back: all-to-alls between pairs
        # of ranks, and beyond two ranks collective-permutes of the whole local stack too
        # (measured, v = 2: 1x the local stack's bytes per step at p = 2, 3x at p = 4 and 8).
        # Storing the stack in the schedule's order removes them (`layout.storage_order`).
        layer = counts.as_params - counts.shared
        params, grads = layout.param_bytes * layer, 4 * layer
        out += [
            Planned(ALL_TO_ALL, (PIPELINE,), params, 1, "interleaved: layers into stage order", True, 2),
            Planned(ALL_TO_ALL, (PIPELINE,), grads, 1, "interleaved: layer gradients back to stack order", True, 2),
        ]
        if layout.p > 2:
            out += [
                Planned(COLLECTIVE_PERMUTE, (PIPELINE,), params, 1, "interleaved: layers into stage order", True),
                Planned(COLLECTIVE_PERMUTE, (PIPELINE,), grads, 1, "interleaved: gradients back to stack order", True),
            ]
    return out


def planned_collectives(layout: Layout, counts: ParamCounts | None = None) -> list[Planned]:
    counts = counts or param_counts(layout)
    return (
        tensor_collectives(layout)
        + data_collectives(layout, counts)
        + expert_collectives(layout)
        + pipeline_collectives(layout, counts)
        + context_collectives(layout)
        + context_gradients(layout, counts)
        + jaxpar_quirks(layout, counts)
        + optimizer_collectives(layout)
    )


def wire_bytes_by_axes(planned: list[Planned], mesh: dict) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for p in planned:
        if p.axes:
            out[p.axes] = out.get(p.axes, 0.0) + p.wire_bytes(mesh)
    return out

