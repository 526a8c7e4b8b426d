"""Context parallelism's collectives, analytically (see `jaxpar.analysis.cost.comm` for the byte
convention): the K/V exchange of each impl per layer (`context_collectives`) and the parameter
gradients' sums over context (`context_gradients`), as jaxpar's step compiles them on XLA:CPU."""

from __future__ import annotations

from jaxpar.analysis.cost.comm_zero import spans_context
from jaxpar.analysis.cost.layout import CONTEXT, EXPERT, TENSOR, Layout, LayoutError
from jaxpar.analysis.cost.memory import ParamCounts
from jaxpar.analysis.cost.planned import Planned
from jaxpar.analysis.program.hlo import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER
from jaxpar.parallel.context.window import hops
from jaxpar.parallel.data import GradientStrategy


def context_reduced_with_data(layout: Layout) -> bool:
    """The pipeline engine and the per-rank accumulation (`parallel.context.accumulation`) are
    manual over context like over the batch axes: below ZeRO-3 their one gradient all-reduce
    after the loop spans both (measured: data 2 x pipeline 2 x context 2, ZeRO 0 and 1; data 4 x
    context 2 x accumulation 2, ZeRO 0 and 1)."""
    return layout.c > 1 and (
        (layout.p > 1 and not layout.zero.shard_params) or layout.gradient is GradientStrategy.PER_RANK
    )


def dispatch_manual_over_context(layout: Layout) -> bool:
    """The dropless MoE dispatch's shard_map is manual over context too (`parallel.expert`; inside
    the pipeline engine, already manual, there is no such shard_map)."""
    return layout.is_moe and layout.c > 1 and layout.capacity_factor == 0 and layout.p == 1


def window_hops(layout: Layout) -> tuple:
    """The hops (`jaxpar.parallel.context.window`) of a sliding layer whose exchange stops at its
    window: ring and all_gather outside the pipeline engine (whose stages run the full exchange),
    when the window leaves some rank or piece out; () when no layer exchanges less."""
    f, c, context = layout.facts, layout.c, layout.plan.context
    if c == 1 or not f.sliding_layers or layout.p > 1 or layout.context_latent or layout.context_impl not in ("ring", "all_gather"):
        return ()
    found = hops(c, layout.seq // c, f.sliding_window, context.load_balance)
    return found if len(found) < c - 1 or any(hop.piece is not None for hop in found) else ()


def _windowed(layout: Layout, found, kv: float, layers: int, passes: int) -> list[Planned]:
    """A sliding layer's hops: its K and V pieces (a whole block kv / c, or one of its two halves)
    in the forward and again in the backward, and their dK, dV (fp32) sent back."""
    out = []
    for half in (False, True):
        count = sum(1 for hop in found if (hop.piece is not None) == half)
        if count:
            piece = kv / layout.c / (2 if half else 1)
            what = "half blocks" if half else "blocks"
            out += [
                Planned(COLLECTIVE_PERMUTE, (CONTEXT,), piece * layout.activation_bytes, 2 * count * layers * (passes + 1),
                        f"CP window: the K and V {what} the window reaches (fwd, and again in the bwd)", overlap=True),
                Planned(COLLECTIVE_PERMUTE, (CONTEXT,), piece * 4, 2 * count * layers,
                        f"CP window: dK and dV of those {what}, sent back (bwd, fp32)", overlap=True),
            ]
    return out


def context_collectives(layout: Layout) -> list[Planned]:
    """Context parallelism (`jaxpar.parallel.context`), per layer on this device's layers, by
    `parallel.context_impl` (c = mesh.context; B = rows, Hkv / Hq heads per tensor rank; kv = B x
    S x Hkv x head_dim, one layer's whole-sequence K or V; measured on compiled HLO, data 4 x
    context 2 and context 2 x tensor 2, every impl; all_gather moving MLA's latents instead of K
    and V when the plan says so, `ContextPlan.latent`):
      all_gather  forward: all-gathers of K and V (kv each, compute dtype); backward: the same
                  again (the kernel keeps only the local shards) and reduce-scatters of dK, dV
                  (kv each, fp32).
      ring        forward: c - 1 collective-permutes of the K and V blocks (kv / c each);
                  backward: c - 1 of K, V and of the travelling dK, dV (fp32), one more of dK, dV.
      all_to_all  forward: q, k, v in and the output back (B x S/c x heads x head_dim each; fewer
                  KV heads than c are repeated to c first); backward: four more of the same sizes.
    A sliding layer (ring and all_gather, outside the pipeline engine) exchanges only the pieces its
    window reaches (`window_hops`, `parallel.context.window`): per hop one collective-permute of
    K and of V (a block or half of one) in the forward, again in the backward, and one of dK and of
    dV (fp32) back to the sender; full layers as above.
    Remat full re-runs the all-to-alls (the other impls' re-run exchanges merge with the backward's).
    The positions ([B, S] int32) are gathered / passed once per step (hoisted out of the layer
    scan): not priced. Parameter gradients are all-reduced over context like over data
    (`data_collectives`)."""
    if layout.c == 1:
        return []
    c, L, cb, axes = layout.c, layout.layers_per_device, layout.activation_bytes, (CONTEXT,)
    hkv = layout.local_kv_heads
    hq = layout.heads // layout.t
    positions = layout.tokens * layout.head_dim  # B x S/c x head_dim elements per head
    impl = layout.context_impl
    # Inside the pipeline engine and the per-rank accumulation (`parallel.context.accumulation`),
    # both manual over context, the per-device kernel runs with tensor (and, in the engine under
    # ZeRO-3, data) left to the partitioner, which gathers the heads over tensor and the rows
    # over data in front of the exchanges over context: each moves t (x d) times the bytes
    # (measured, Llama 3 70B pipeline 2 x context 2 x tensor 2, data 2 x pipeline 2 x context
    # 2 ZeRO-3, and per rank data 2 x context 2 x tensor 2 and context 4 x tensor 2 at test size;
    # the ring's permutes keep the heads split). A nested shard_map manual over tensor would
    # avoid it, but fails to lower in jax 0.10.2 (Shardy: "manual axis tensor after free axis").
    # A jaxpar inefficiency, priced as it is.
    per_rank = layout.gradient is GradientStrategy.PER_RANK and layout.t > 1 and impl != "ring"
    if layout.p > 1 or per_rank:
        hkv, hq = layout.kv_heads, layout.heads
        if layout.p > 1 and layout.zero.shard_params:
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
    local = kv / c * cb  # one layer's local K (or V) with every head
    if layout.context_latent:
        # MLA's latents and RoPE keys (`parallel.context.latent`): gathered in the forward and again
        # in the backward's recompute, their gradients reduce-scattered (fp32); replicated over tensor.
        latents = layout.tokens * c * layout.facts.kv_latent_width
        return [
            Planned(ALL_GATHER, axes, latents * cb, L * (passes + 1), "CP latent all-gather: latents (fwd, and in the bwd)"),
            Planned(REDUCE_SCATTER, axes, latents * 4, L, "CP latent all-gather: the latents' gradients (bwd, fp32)"),
        ]
    found = window_hops(layout)
    sliding = layout.facts.sliding_layers if found else 0
    windowed = _windowed(layout, found, kv, sliding, passes) if sliding else []
    L -= sliding  # the layers that exchange everything
    if impl == "all_gather":
        out = windowed + [
            Planned(ALL_GATHER, axes, kv * cb, 2 * L * (passes + 1), "CP all-gather: K and V (fwd, and again in the bwd)"),
            Planned(REDUCE_SCATTER, axes, kv * 4, 2 * L, "CP all-gather: dK and dV (bwd, fp32)"),
        ]
        if layout.t > 1 and (layout.p > 1 or per_rank):
            # The heads' gathers over tensor, per layer and microbatch: K and V in the forward and
            # the backward (in a pipeline stage's B twice: the recompute, the backward) plus the
            # gathered whole-sequence K and V (measured: Llama 3 70B pipeline 2 x context 2 x
            # tensor 2; at test size, and per rank with context 2 and 4, remat none and full).
            # (Sliding layers' hops: the local K and V only, not measured.)
            count = layout.layers_per_device * 2 * (passes + 1) + L * 2 * c
            out.append(Planned(ALL_GATHER, (TENSOR,), local, count, "CP: heads gathered over tensor", True))
        return [p for p in out if p.count]
    if impl == "ring":
        block = kv / c
        out = windowed + [
            Planned(COLLECTIVE_PERMUTE, axes, block * cb, 2 * (c - 1) * L * (passes + 1),
                    "CP ring: K and V blocks (fwd, and again in the bwd)", overlap=True),
            Planned(COLLECTIVE_PERMUTE, axes, block * 4, 2 * c * L, "CP ring: dK and dV accumulators (bwd, fp32)", overlap=True),
        ]
        return [p for p in out if p.count]
    if impl == "all_to_all":
        q = positions * hq
        k = positions * max(hkv, c)
        per_pass = 2 * q + 2 * k
        out = [
            Planned(ALL_TO_ALL, axes, per_pass / 4 * cb, 4 * L * (fwd + 1), "CP all-to-all: q, k, v in, output back (fwd and bwd)"),
        ]
        if per_rank and layout.p == 1:
            # Per rank, the heads' gathers over tensor: 6 local K/V per layer, 10 under remat full
            # (measured at test size, data 2 x context 2 x tensor 2 and context 4 x tensor 2).
            out.append(Planned(ALL_GATHER, (TENSOR,), local, L * (2 + 4 * fwd), "CP: heads gathered over tensor", True))
        return out
    raise LayoutError(f"parallel.context_impl={impl!r} is not one of ('all_gather', 'ring', 'all_to_all')")


def context_gradients(layout: Layout, counts: ParamCounts) -> list[Planned]:
    """Parameters are replicated over context: their gradients are summed over it like over data
    replicas. XLA:CPU reduces them over context in an all-reduce of its own, not merged with the
    one over data (measured, data 4 x context 2), except the MoE expert weights' (`data_collectives`:
    the dispatch's shard_map sums them over data and context at once) and, with experts on their
    own axis under ZeRO-1, the data shards (summed over context and expert at once). The pipeline
    engine without ZeRO reduces over data and context at once (`data_collectives`).

    How often: once per step with gradient accumulation on dense models below ZeRO-3, where every
    (replica, context rank) accumulates its own partial gradient (`GradientStrategy.PER_RANK`;
    before it, the partitioner summed each layer's gradient over context inside the layer scan,
    once per microbatch: Llama 3 70B data 4 x context 2, 36 TB per step where 0.28 TB would do);
    per microbatch for MoE models and ZeRO-3. What: ZeRO 0 the gradients; ZeRO-1 their data
    shards (after the reduce-scatter; the shared tables' whole, ~12% more, not priced); ZeRO-3
    each layer's whole gradient per microbatch before the data reduce-scatter."""
    if layout.c == 1 or context_reduced_with_data(layout):
        return []
    m = layout.microbatches
    experts = 4 * counts.experts * layout.layers_per_device if dispatch_manual_over_context(layout) else 0
    if layout.zero.shard_params and layout.p > 1:
        # The engine, manual over context, accumulates per context rank: one all-reduce of the
        # data shards after it (measured, Llama 3 70B data 2 x pipeline 2 x context 2).
        return [Planned(ALL_REDUCE, (CONTEXT,), 4 * counts.as_params, 1, "CP: gradient shards over context (ZeRO-3, after the engine)")]
    spanned = spans_context(layout)  # ZeRO over data x context (`comm_zero`): its table's gradient is its own
    if spanned and layout.zero.gathers_updated_params:
        return []  # reduce-scattered over data x context with the rest
    if layout.zero.shard_params:
        whole = 4 * (layout.layers_per_device * counts.layer_gathered + counts.shared_gathered) - experts
        out = []
        if spanned:
            whole -= 4 * counts.embedding
            if layout.is_moe and layout.e > 1:
                whole -= 4 * counts.head
        elif layout.is_moe and layout.e > 1:
            # One vocab table's data shard is summed over context and expert together instead
            # (measured, Mixtral 8x7B data 2 x context 2 x expert 2).
            whole -= 4 * counts.head
            out.append(Planned(ALL_REDUCE, (CONTEXT, EXPERT), 4 * counts.head / layout.d, m, "CP x EP: a vocab table's shard (ZeRO-3 MoE)"))
        return out + [Planned(ALL_REDUCE, (CONTEXT,), whole, m, "CP: gradients over context (ZeRO-3, per microbatch)", overlap=True)]
    # Dense models below ZeRO-3 with accumulation returned above: m > 1 here is MoE, which reduces
    # per microbatch by design (`_reductions_per_step`).
    if layout.zero.gathers_updated_params:
        if layout.is_moe and layout.e > 1:
            return []  # summed with the expert axis
        grads = 4 * counts.as_optimizer - experts / layout.d
    else:
        grads = 4 * counts.as_params - experts
    return [Planned(ALL_REDUCE, (CONTEXT,), grads, m, "CP: gradients over context")]
