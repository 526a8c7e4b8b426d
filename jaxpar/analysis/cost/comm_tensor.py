"""Tensor parallelism's planned collectives: the row-parallel reductions (or, with sequence
parallelism, the sequence gathers and scatters; with collective matmul, their rings of permutes)
of each layer, the LM head's and the vocab-parallel embedding's. The rules are `jaxpar.analysis.cost.comm`'s
module docstring's; this file holds the tensor part of them."""

from __future__ import annotations

from jaxpar.analysis.cost.layout import TENSOR, Layout
from jaxpar.analysis.cost.memory import moe_matmul_rows_per_token
from jaxpar.analysis.cost.planned import Planned, lowering_for
from jaxpar.analysis.program.hlo import ALL_GATHER, ALL_REDUCE, COLLECTIVE_PERMUTE, REDUCE_SCATTER
from jaxpar.parallel.data import GradientStrategy


def scatter_kind(layout: Layout) -> str:
    return ALL_REDUCE if lowering_for(layout).reduce_scatter_as_all_reduce else REDUCE_SCATTER


# ---- tensor ----------------------------------------------------------------------------------


# Collective matmul's rings a layer's recompute runs again per remat policy (of its four: qkv in,
# attention out, MLP in, MLP out; full skips the MLP's down projection as in the plain path).
CM_RECOMPUTED_RINGS = {"none": 0, "save_dots": 2, "full": 3}


def collective_matmul_permutes(t: int) -> list[tuple[int, int]]:
    """(sequence chunks per permute, permutes) of one collective-matmul exchange over t ranks
    (`jaxpar.parallel.collective_matmul`): a power-of-two t swaps runs of 1, 2, 4 .. t/2 chunks
    with rank r xor d, once each; another t passes one chunk round a ring t − 1 times."""
    if t & (t - 1):
        return [(1, t - 1)]
    return [(1 << i, 1) for i in range(t.bit_length() - 1)]


def tp_layers(layout: Layout, act: float, forward_passes: int, tag: str) -> list[Planned]:
    """The tensor-parallel exchanges of this device's layers over activations of `act` bytes:
    two per layer per forward pass (attention and MLP outputs, row-parallel), one more per layer
    with remat full (it recomputes the attention, not the MLP's down projection, whose output
    the backward never needs: measured, tensor=4 remat full), and the backward's input
    gradients as the lowering reduces them. With sequence parallelism every all-reduce is an
    all-gather of the sequence plus a reduce-scatter of the same bytes."""
    axes, low, L = (TENSOR,), lowering_for(layout), layout.layers_per_device
    # XLA:CPU runs MoE experts as a tiled loop (`kernels.grouped_matmul`) and reduces each
    # tile's partial sums over tensor inside it: per layer the forward's down projection, the
    # backward's input gradient of gate and up (one grouped matmul over both), and the recomputed
    # forward unless remat is none (measured: Mixtral-shaped, data 2 x tensor 4). The HLO counts
    # every tile, taken or not.
    tiled = layout.is_moe and layout.target == "cpu"
    # Layers that route, layers with a dense MLP, and (Qwen2-MoE) routing layers whose shared
    # expert is a row-parallel MLP too: its output reduced in every forward pass, its input
    # gradient like the dense MLP's (measured: Qwen2-MoE-shaped expert 2 x tensor 2, exact).
    share = layout.facts.moe.layer_share if layout.is_moe else 0.0
    routed, dense = L * share, L * (1 - share)
    shared_mlp = routed if layout.is_moe and layout.facts.moe.shared_ffn else 0.0
    mlp_grads = dense + shared_mlp
    fwd = ((1 if tiled else 2) * forward_passes + (1 if layout.remat == "full" else 0)) * L
    fwd += forward_passes * (shared_mlp + (dense if tiled else 0))
    # In a pipeline stage (two forward passes) remat full's extra attention recompute reuses the
    # sequence the stage's recompute gathered: one SP gather fewer per layer (measured, pipeline
    # 2 x tensor 4, remat full: 2 + 4 gathers and 2 + 1 + 5 reductions per layer and microbatch).
    fwd_gathers = fwd - (L if layout.remat == "full" and forward_passes == 2 else 0)
    out = []
    if tiled:
        rows = moe_matmul_rows_per_token(layout) * layout.tokens
        # Forward passes (a pipeline stage's B re-runs F's, remat re-runs them once more) plus
        # the backward's one (tensor bytes measured: Qwen2-MoE-shaped expert 2 x tensor 2, remat
        # none exact, remat full -3.5%; Mixtral-shaped pipeline 2 x tensor 2, remat full +0.01%).
        passes = forward_passes + (0 if layout.remat == "none" else 1) + 1
        out.append(Planned(ALL_REDUCE, axes, rows * layout.hidden * 4, routed * passes,
                           f"{tag}: expert partial sums per tile (XLA:CPU)", True))
    widths = layout.facts.latent_widths
    if layout.sequence_parallel:
        scatter = scatter_kind(layout)
        # (Every layer's MLP-sized scatters, MoE or not, as measured; a shared expert's on top is
        # priced by analogy with the all-reduce case, not measured under SP.)
        bwd_scatters = (low.attention_input_grad_all_reduces + low.mlp_input_grad_all_reduces) * L
        bwd_scatters += low.mlp_input_grad_all_reduces * shared_mlp
        if widths:  # MLA gathers its latents, not the layer input, and scatters their gradients
            latent = act * sum(widths) / layout.hidden
            out += [
                Planned(ALL_GATHER, axes, latent, forward_passes * L, f"{tag}: SP gathers MLA's latents (fwd)"),
                Planned(scatter, axes, latent, L, f"{tag}: SP scatters MLA's latent gradients (bwd)"),
            ]
            fwd_gathers -= forward_passes * L
            bwd_scatters -= low.attention_input_grad_all_reduces * L
        if layout.plan.tensor.collective_matmul:
            # Each gather and scatter an exchange of chunks beside the partial matmuls; their
            # transposes in the backward as many again; remat re-runs some (measured, data 2 x tensor 4,
            # per layer in the compiled step: 8 exchanges with remat none, 10 with save_dots, 11 with
            # full, and no projection gathers). Overlapped: each permute's matmul does not wait for it.
            rings = (2 * forward_passes * 4 + CM_RECOMPUTED_RINGS[layout.remat]) * L
            return out + [
                Planned(COLLECTIVE_PERMUTE, axes, act * chunks / layout.t, rings * count,
                        f"{tag}: collective matmul's permutes of {chunks} chunk(s) (fwd, bwd, recompute)", overlap=True)
                for chunks, count in collective_matmul_permutes(layout.t)
            ]
        return out + [
            Planned(ALL_GATHER, axes, act, fwd_gathers, f"{tag}: SP gathers the sequence before attention / MLP (fwd)"),
            Planned(scatter, axes, act, fwd, f"{tag}: SP scatters attention / MLP outputs (fwd)"),
            Planned(ALL_GATHER, axes, act, low.sp_backward_gathers * L, f"{tag}: SP gathers output gradients (bwd)"),
            Planned(scatter, axes, act, bwd_scatters, f"{tag}: SP scatters input gradients (bwd)"),
        ]
    out.append(Planned(ALL_REDUCE, axes, act, fwd, f"{tag}: attention and MLP outputs (fwd, row-parallel)"))
    if widths:  # MLA: the up-projections' input gradients, one per latent, where the heads meet
        out += [Planned(ALL_REDUCE, axes, act * w / layout.hidden, L, f"{tag}: MLA latent gradient (bwd)") for w in widths]
    else:
        out.append(Planned(ALL_REDUCE, axes, act, L * low.attention_input_grad_all_reduces, f"{tag}: attention input gradient (bwd)"))
    if not layout.is_moe or mlp_grads:
        count = L if not layout.is_moe else mlp_grads
        out.append(Planned(ALL_REDUCE, axes, act, count * low.mlp_input_grad_all_reduces, f"{tag}: MLP input gradient (bwd)"))
    return out


def tensor_collectives(layout: Layout) -> list[Planned]:
    if layout.t == 1 or layout.p > 1:  # inside pipeline stages: `pipeline_collectives`
        return []
    axes = (TENSOR,)
    act = layout.tokens * layout.hidden * layout.activation_bytes
    out = tp_layers(layout, act, 1, "TP")
    if layout.sequence_parallel:
        out.append(Planned(ALL_GATHER, axes, act, 1, "SP: gather the sequence for the LM head"))
        if layout.gradient is GradientStrategy.PER_REPLICA:
            # Per-replica accumulation (vmapped over data) gathers each layer's attention and MLP
            # inputs once more per forward pass (measured: data 2 x tensor 4, accum 2 and 4); the
            # per-rank accumulation's shard_map does not (measured: Llama 3 70B data 2 x context 2
            # x tensor 2 SP remat none, and at test size).
            passes = 2 if layout.remat == "full" else 1
            out.append(Planned(ALL_GATHER, axes, act, 2 * passes * layout.layers_per_device, "SP: per-replica re-gathers", True))
    head_dx = layout.tokens * layout.hidden * 4
    uses = layout.facts.table_uses  # multi-token prediction looks up and projects once more per depth
    out += [
        Planned(ALL_REDUCE, axes, act, uses, "TP: vocab-parallel embedding lookup"),
        Planned(ALL_REDUCE, axes, head_dx, uses, "TP: LM head input gradient (fp32)"),
        Planned(ALL_REDUCE, axes, layout.tokens * 4, 3 * uses, "TP: vocab-parallel loss (max, sum, label logit)"),
    ]
    return out


# ---- data, ZeRO ---------------------------------------------------------------------------------
