"""Context parallelism's collectives, analytically (see `jaxpar.analysis.comm` for the byte
convention): the K/V exchange of each impl per layer (`context_collectives`) and the parameter
gradients' sums over context (`context_gradients`), as jaxpar's step compiles them on XLA:CPU."""

from __future__ import annotations

from jaxpar.analysis.hlo import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER
from jaxpar.analysis.layout import CONTEXT, EXPERT, TENSOR, Layout, LayoutError
from jaxpar.analysis.memory import ParamCounts
from jaxpar.analysis.planned import Planned


def engine_reduces_context(layout: Layout) -> bool:
    """The pipeline engine is manual over context like over the batch axes: below ZeRO-3 its
    one gradient all-reduce after the engine spans both (measured, data 2 x pipeline 2 x context
    2, ZeRO 0 and 1)."""
    return layout.p > 1 and layout.c > 1 and layout.zero_stage < 3


def dispatch_manual_over_context(layout: Layout) -> bool:
    """The dropless MoE dispatch's shard_map is manual over context too (`parallel.expert`; inside
    the pipeline engine, already manual, there is no such shard_map)."""
    return layout.is_moe and layout.c > 1 and layout.capacity_factor == 0 and layout.p == 1


def context_collectives(layout: Layout) -> list[Planned]:
    """Context parallelism (`jaxpar.parallel.context`), per layer on this device's layers, by
    `parallel.context_impl` (c = mesh.context; B = rows, Hkv / Hq heads per tensor rank; kv = B x
    S x Hkv x head_dim, one layer's whole-sequence K or V; measured on compiled HLO, data 4 x
    context 2 and context 2 x tensor 2, every impl):
      all_gather  forward: all-gathers of K and V (kv each, compute dtype); backward: the same
                  again (the kernel keeps only the local shards) and reduce-scatters of dK, dV
                  (kv each, fp32).
      ring        forward: c - 1 collective-permutes of the K and V blocks (kv / c each);
                  backward: c - 1 of K, V and of the travelling dK, dV (fp32), one more of dK, dV.
      all_to_all  forward: q, k, v in and the output back (B x S/c x heads x head_dim each; fewer
                  KV heads than c are repeated to c first); backward: four more of the same sizes.
    Remat full re-runs the all-to-alls (the other impls' re-run exchanges merge with the backward's).
    The positions ([B, S] int32) are gathered / passed once per step (hoisted out of the layer
    scan): not priced. Parameter gradients are all-reduced over context like over data
    (`data_collectives`)."""
    if layout.c == 1:
        return []
    c, L, cb, axes = layout.c, layout.layers_per_device, layout.activation_bytes, (CONTEXT,)
    hkv = layout.kv_heads // layout.t if layout.kv_sharded else 1
    hq = layout.heads // layout.t
    positions = layout.tokens * layout.head_dim  # B x S/c x head_dim elements per head
    if layout.p > 1:
        # Inside the pipeline engine the per-device kernel runs with tensor (and, under ZeRO-3,
        # data) left to the partitioner, which gathers the heads over tensor and the rows over
        # data in front of the exchanges over context: each moves t (x d) times the bytes
        # (measured, Llama 3 70B pipeline 2 x context 2 x tensor 2, data 2 x pipeline 2 x context
        # 2 ZeRO-3; `context.sharded.model_attention`: a nested shard_map fails to lower). A
        # jaxpar inefficiency, priced as it is.
        hkv, hq = layout.kv_heads, layout.heads
        if layout.zero_stage >= 3:
            positions *= layout.d
    kv = positions * c * hkv  # one layer's whole-sequence K (or V), elements
    # Remat full re-runs the forward: the all-to-alls (outside the kernel's custom VJP) again; the
    # all-gathers and ring permutes of the re-run equal the backward's own and XLA merges them
    # (measured: remat full moves the same bytes as none for all_gather and ring).
    # In a pipeline stage F runs the forward and B re-runs it before the backward: the forward's
    # exchanges twice, none merged (measured, data 2 x pipeline 2 x context 2: 6 K/V gathers
    # per layer and microbatch).
    passes = 2 if layout.p > 1 else 1
    fwd = 2 if layout.remat == "full" or layout.p > 1 else 1
    impl = layout.context_impl
    if impl == "all_gather":
        out = [
            Planned(ALL_GATHER, axes, kv * cb, 2 * L * (passes + 1), "CP all-gather: K and V (fwd, and again in the bwd)"),
            Planned(REDUCE_SCATTER, axes, kv * 4, 2 * L, "CP all-gather: dK and dV (bwd, fp32)"),
        ]
        if layout.p > 1 and layout.t > 1:
            # The heads' gathers over tensor, per layer and microbatch: K and V in F, and in B
            # twice (the recompute, the backward) plus the gathered whole-sequence K and V
            # (measured: Llama 3 70B pipeline 2 x context 2 x tensor 2, and at test size).
            local = kv / c * cb
            out.append(Planned(ALL_GATHER, (TENSOR,), local, L * (6 + 2 * c), "PP+CP: heads gathered over tensor", True))
        return out
    if impl == "ring":
        block = kv / c
        return [
            Planned(COLLECTIVE_PERMUTE, axes, block * cb, 2 * (c - 1) * L * (passes + 1), "CP ring: K and V blocks (fwd, and again in the bwd)"),
            Planned(COLLECTIVE_PERMUTE, axes, block * 4, 2 * c * L, "CP ring: dK and dV accumulators (bwd, fp32)"),
        ]
    if impl == "all_to_all":
        q = positions * hq
        k = positions * max(hkv, c)
        per_pass = 2 * q + 2 * k
        return [
            Planned(ALL_TO_ALL, axes, per_pass / 4 * cb, 4 * L * (fwd + 1), "CP all-to-all: q, k, v in, output back (fwd and bwd)"),
        ]
    raise LayoutError(f"parallel.context_impl={impl!r} is not one of ('all_gather', 'ring', 'all_to_all')")


def context_gradients(layout: Layout, counts: ParamCounts) -> list[Planned]:
    """Parameters are replicated over context: their gradients are summed over it like over data
    replicas. XLA:CPU reduces them over context in an all-reduce of its own, not merged with the
    one over data (measured, data 4 x context 2), except the MoE expert weights' (`data_collectives`:
    the dispatch's shard_map sums them over data and context at once) and, with experts on their
    own axis under ZeRO-1, the data shards (summed over context and expert at once). The pipeline
    engine without ZeRO reduces over data and context at once (`data_collectives`).

    How often: the partitioner sums each layer's gradient over context inside the layer scan, so
    with gradient accumulation once per microbatch, whatever the gradient strategy: per-replica
    accumulation keeps a per-replica gradient over `data` only (measured: Llama 3 70B data 2/4 x
    context 2/4 x accum 128/256 and at test size, full gradients every microbatch, also under
    ZeRO-1). That is a jaxpar inefficiency (`quirk`): a per-(replica, context rank) accumulator, as
    the pipeline engine keeps, would sum once per step. What: ZeRO 0 the gradients; ZeRO-1 without
    accumulation their data shards (after the reduce-scatter; the shared tables' whole, ~12% more,
    not priced), with it the whole gradients (dense) or the data shards (MoE, reduced per
    microbatch anyway); ZeRO-3 each layer's whole gradient per microbatch before the data
    reduce-scatter."""
    if layout.c == 1 or engine_reduces_context(layout):
        return []
    m = layout.microbatches
    experts = 4 * counts.experts * layout.layers_per_device if dispatch_manual_over_context(layout) else 0
    if layout.zero_stage >= 3 and layout.p > 1:
        # The engine, manual over context, accumulates per context rank: one all-reduce of the
        # data shards after it (measured, Llama 3 70B data 2 x pipeline 2 x context 2).
        return [Planned(ALL_REDUCE, (CONTEXT,), 4 * counts.as_params, 1, "CP: gradient shards over context (ZeRO-3, after the engine)")]
    if layout.zero_stage >= 3:
        whole = 4 * (layout.layers_per_device * counts.layer_gathered + counts.shared_gathered) - experts
        out = []
        if layout.is_moe and layout.e > 1:
            # One vocab table's data shard is summed over context and expert together instead
            # (measured, Mixtral 8x7B data 2 x context 2 x expert 2).
            whole -= 4 * counts.head
            out.append(Planned(ALL_REDUCE, (CONTEXT, EXPERT), 4 * counts.head / layout.d, m, "CP x EP: a vocab table's shard (ZeRO-3 MoE)"))
        return out + [Planned(ALL_REDUCE, (CONTEXT,), whole, m, "CP: gradients over context (ZeRO-3, per microbatch)")]
    # MoE reduces per microbatch by design (`_reductions_per_step`); the pipeline engine is manual
    # over context and reduces once, after it.
    per_microbatch = m > 1 and not layout.is_moe and layout.p == 1
    if layout.p > 1:
        m = 1
    if layout.zero_stage == 1 and not per_microbatch:
        if layout.is_moe and layout.e > 1:
            return []  # summed with the expert axis
        grads = 4 * counts.as_optimizer - experts / layout.d
    else:
        grads = 4 * counts.as_params - experts
    what = "CP: gradients over context" + (" per microbatch (accumulation over data only)" if per_microbatch else "")
    return [Planned(ALL_REDUCE, (CONTEXT,), grads, m if m > 1 else 1, what, quirk=per_microbatch)]
