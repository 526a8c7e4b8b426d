"""ZeRO over data x context (`parallel.zero_axes`): its collectives, analytically (see
`jaxpar.analysis.cost.comm` for the byte convention and `jaxpar.parallel.zero` for the design).

With the optimizer state (and at stage 3 the parameters) split over data x context, XLA compiles
jaxpar's step to these (measured on 8 emulated devices at test size, Llama and Mixtral, data 2-4 x
context 2 with and without tensor 2 and expert 2, gradient accumulation 1-2; and on the 70B and
Mixtral 8x7B sweeps):

  ZeRO-1  the gradients (less the token table's) reduce-scattered over data x context once per
          reduction (per microbatch under plain accumulation; with per-rank accumulation or after the
          pipeline engine the one all-reduce over the batch axes and context already covers both,
          `comm.data_collectives`); the token table's gradient all-reduced over data and over context
          apart; the updated parameters all-gathered over data x context. With experts on their own
          axis the shards are then all-reduced over expert, and the embedding's output cotangent
          moves by all-to-all over data x expert and permutes over context x expert.
  ZeRO-3  each layer's weights (and the LM head, and a table that is not vocab-parallel) all-gathered
          over data x context; the layer gradients still all-reduced over context whole and
          reduce-scattered over data (the partitioner sums the context partials first,
          `comm_context.context_gradients`), and the token table's gradient all-reduced over data x
          context.
"""

from __future__ import annotations

from jaxpar.analysis.cost.layout import CONTEXT, DATA, EXPERT, Layout
from jaxpar.analysis.cost.memory import ParamCounts
from jaxpar.analysis.cost.planned import Planned, lowering_for, present_axes
from jaxpar.analysis.program.hlo import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER


def spans_context(layout: Layout) -> bool:
    """ZeRO shards over context too (and context is split)."""
    return layout.zero.shard_optimizer_state and layout.c > 1 and CONTEXT in layout.zero.axes


def zero_axes(layout: Layout) -> tuple[str, ...]:
    return present_axes(layout, *layout.zero.axes)


def _scatter(layout: Layout) -> str:
    return ALL_REDUCE if lowering_for(layout).reduce_scatter_as_all_reduce else REDUCE_SCATTER


def zero1(layout: Layout, counts: ParamCounts, grads: float, k: int, reduced_with_data: bool) -> list[Planned]:
    """ZeRO-1 over data x context: `grads` bytes of gradients (expert weights' excluded where the
    dispatch reduces them), reduced `k` times per step; `reduced_with_data`: the per-rank or
    pipeline reduction over batch axes and context already made them (`comm.data_collectives`)."""
    axes, pb = zero_axes(layout), layout.param_bytes
    out = [
        Planned(ALL_GATHER, axes, pb * (counts.as_params - counts.embedding), 1, "ZeRO-1: updated parameters"),
        Planned(ALL_GATHER, axes, pb * counts.embedding, 1, "ZeRO-1: updated embedding"),
    ]
    if reduced_with_data:
        return out
    table = 4 * counts.embedding
    moe_apart = layout.is_moe and layout.e > 1 and layout.p == 1
    scatter_axes = axes if moe_apart or layout.e == 1 else present_axes(layout, DATA, CONTEXT, EXPERT)
    out.append(Planned(_scatter(layout), scatter_axes, grads - table, k, "ZeRO-1: gradient reduce-scatter"))
    if moe_apart:
        shards = layout.d * layout.c
        mb_tokens = layout.tokens / layout.microbatches
        out += [
            Planned(ALL_REDUCE, (EXPERT,), grads / shards, k, "ZeRO-1 MoE: shards over expert"),
            _cotangent_all_to_all(layout),
            Planned(COLLECTIVE_PERMUTE, (CONTEXT, EXPERT), mb_tokens * layout.hidden * 4, 2 * layout.microbatches,
                    "ZeRO MoE: embedding cotangent over context x expert", True),
        ]
    else:
        out += [
            Planned(ALL_REDUCE, (DATA,), table, k, "ZeRO-1: embedding gradient over data"),
            Planned(ALL_REDUCE, (CONTEXT,), table, k, "ZeRO-1: embedding gradient over context"),
        ]
    return out


def zero3_gathers(layout: Layout, counts: ParamCounts, gathers: int) -> list[Planned]:
    """ZeRO-3 over data x context: the weights gathered over both (the layer scan's per layer,
    fwd and bwd; the LM head per microbatch)."""
    axes, L, m, cb = zero_axes(layout), layout.layers_per_device, layout.microbatches, layout.activation_bytes
    return [
        Planned(ALL_GATHER, axes, cb * counts.layer_gathered, L * m * gathers, "ZeRO-3: layer weights (fwd and bwd)", overlap=True),
        Planned(ALL_GATHER, axes, cb * counts.head, m, "ZeRO-3: LM head weights"),
    ]


def zero3_embedding(layout: Layout, counts: ParamCounts) -> list[Planned]:
    """The token table under ZeRO-3 over data x context: gathered over both (over data alone when it
    is vocab-parallel or experts have their axis), its gradient all-reduced over both."""
    axes, m, cb = zero_axes(layout), layout.microbatches, layout.activation_bytes
    out = [Planned(ALL_REDUCE, axes, 4 * counts.embedding, m, "ZeRO-3: embedding gradient over data x context")]
    if not (layout.is_moe and layout.e > 1):
        gather_axes = axes if layout.t == 1 and layout.e == 1 else present_axes(layout, DATA)
        return out + [Planned(ALL_GATHER, gather_axes, cb * counts.embedding, m, "ZeRO-3: embedding table")]
    # Experts on their own axis: the lookup's output cotangent moves instead of the table (smaller
    # gathers over expert and an all-to-all over data x context, <0.2% of the bytes, not priced).
    return out + [
        Planned(ALL_REDUCE, (EXPERT,), 4 * counts.head / layout.d, m, "ZeRO-3 MoE: a vocab table's shard over expert"),
        _cotangent_all_to_all(layout),
        Planned(COLLECTIVE_PERMUTE, (CONTEXT, EXPERT), layout.tokens / m * layout.hidden * 4, 3 * m,
                "ZeRO MoE: embedding cotangent over context x expert", True),
    ]


def _cotangent_all_to_all(layout: Layout) -> Planned:
    """MoE with experts on their own axis: each microbatch's embedding output cotangent [rows, S/c,
    D] moved by all-to-all over data x expert for the table's gradient (instead of the all-gather of
    `comm._embedding_cotangent_replicated` when ZeRO spans data alone)."""
    rows = layout.tokens / layout.microbatches * layout.d * layout.e
    return Planned(ALL_TO_ALL, present_axes(layout, DATA, EXPERT), rows * layout.hidden * 4 / layout.c, layout.microbatches,
                   "ZeRO MoE: embedding cotangent by all-to-all", True)
