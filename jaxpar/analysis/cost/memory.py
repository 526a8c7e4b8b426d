"""Per-device memory of jaxpar's training step, analytically.

State (parameters, AdamW's two moments) is exact: every leaf of the model's parameter tree is
sharded by the same rules table jaxpar uses (`jaxpar.sharding.rules_table`). Everything else is a
count of the buffers the step keeps, per device:

  grads          fp32 gradients as the step holds them: sharded like the parameters, or like the
                 optimizer state under ZeRO >= 1 (XLA reduces each layer's gradient inside the
                 backward loop and keeps only its shard). With LoRA only the adapters' (the frozen
                 base has neither gradients nor optimizer state; `jaxpar.models.lora`).
  stash          what the layer scan saves for the backward, per layer and token
                 (`saved_per_token_layer`): the residuals JAX saves under the remat policy —
                 none: every intermediate autodiff needs; save_dots: the projection outputs;
                 full: the layer input. Counted from the block's structure; the test suite
                 checks the count against `jax`'s own list of saved residuals.
  param_cast     a compute-dtype copy of the parameters when it differs from the param dtype
                 (`models.apply` casts them once; the copy is a residual of the whole step).
  working        one layer's backward at a time: its full residuals (times a factor measured on
                 XLA:CPU: x1.0 none, x0.8 save_dots, x1.3 full — recompute holds the recomputed
                 residuals and their cotangents), the layer's unsharded fp32 weight gradients, and
                 one vocab-table gradient; or, at long sequences, the attention's [S, S] buffers
                 (`SCORE_WORKING_FACTOR`); or the loss phase: ~4 fp32 [tokens, vocab/t] buffers;
                 whichever is largest. With flash attention (cuDNN on GPU) there are no [S, S]
                 buffers: not measured in this project (no GPU), taken from how the kernel works.

Peak = state + max(backward phase, optimizer phase). The backward phase holds grads, stash,
param_cast and the working set; the optimizer phase holds three gradient-sized fp32
buffers (`OPTIMIZER_GRAD_BUFFERS`, measured: temp = 2.96 x grads on XLA:CPU when it dominates).
Small buffers (scalars, metrics, norms' statistics) are ignored, so tiny
models read low.

Pipeline (p > 1) and MoE layers are priced by `pipeline_memory` / the MoE residual terms below.
Context parallelism: every per-token term counts seq / context tokens per device
(`Layout.tokens`); its kernels save q, k, v, the output and the log-sum-exp instead of scores, and
their backward adds score blocks and K/V blocks to the working set (`context_attention_buffers`).
With the pipeline's vocab "spread" the tables' gradient and the loss buffers are split over
pipeline x tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar import objective
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.cost.leaves import model_leaves as _model_leaves
from jaxpar.analysis.cost.leaves import shard_elements as _shard_elements
from jaxpar.analysis.cost.optimizer_terms import optimizer_terms
from jaxpar.kernels.grouped_matmul import group_tile, layout_rows
from jaxpar.models import lora
from jaxpar.parallel.context.blockwise import chunk_size
from jaxpar.parallel.data import GradientStrategy
from jaxpar.sharding import rules_table

# Backward working set of one layer, in multiples of the layer's remat-none residuals; measured on
# XLA:CPU (single device and data=8, fp32, 4 layers): none 1.00, save_dots 0.74-0.81, full 1.28.
WORKING_FACTOR = {"none": 1.0, "save_dots": 0.8, "full": 1.3}
# MoE layers hold their dispatch buffers (send, receive, return) and their cotangents on top:
# measured 1.7-3.0 (ep 2-8, all remat policies, XLA:CPU's tiled expert matmuls); 2.2 is the middle.
MOE_WORKING_FACTOR = 2.2
# The backward of one attention layer holds its [S, S] score buffers (recomputed, saved or not,
# their cotangents) several times over, in multiples of the scores and probabilities one layer
# saves without remat; measured on XLA:CPU at Llama-3-70B width (64 and 16 heads, S 2048 / 8192,
# bf16): one row per device: none 1.55, save_dots 2.27, full 2.28; 64 rows: save_dots 1.80, full
# 1.82. The middle is taken (peak within 10% at both ends). Where the scores dominate, this is the
# working set (the D-sized buffers fit into it: with 64 heads at S 8192 they add under 2%).
SCORE_WORKING_FACTOR = {"none": 1.5, "save_dots": 2.0, "full": 2.0}
# Gradient-sized fp32 buffers live while AdamW updates: measured on XLA:CPU where this phase is
# the peak (data 8, context 8, data 4 x context 2; fp32, remat full, 1-2 rows per device): temp
# 2.96 x the gradients (the gradients, the clipped update, and a third not yet attributed; the
# model said 2 before the training loop's non-finite step policy landed).
OPTIMIZER_GRAD_BUFFERS = 3
# fp32 [tokens, vocab/t] buffers live while the loss and its gradient are computed (exp, masked
# logits, label mask, the logits' cotangent; JAX's saved-residual list shows three plus bools).
LOSS_BUFFERS = 4


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device. `peak` is the model's prediction of the step's live maximum."""

    params: int
    optimizer: int
    grads: int
    stash: int
    param_cast: int
    working: int
    pipeline_buffers: int = 0
    grad_carry: int = 0  # with accumulation: the running sum and a microbatch's fresh gradients
    optimizer_grad_buffers: int = OPTIMIZER_GRAD_BUFFERS  # gradient-sized buffers while AdamW updates (a count)
    optimizer_working: int = 0  # the optimizer record's own temporaries beyond that (Muon's whole matrices)

    @property
    def state(self) -> int:
        return self.params + self.optimizer

    @property
    def backward_grads(self) -> int:
        """Gradient bytes live during the backward."""
        return self.grad_carry or self.grads

    @property
    def backward_phase(self) -> int:
        return self.backward_grads + self.stash + self.param_cast + self.working + self.pipeline_buffers

    @property
    def optimizer_phase(self) -> int:
        return self.optimizer_grad_buffers * self.grads + self.optimizer_working

    @property
    def temp(self) -> int:
        return max(self.backward_phase, self.optimizer_phase)

    @property
    def peak(self) -> int:
        return self.state + self.temp

    def rows(self) -> list[tuple[str, int]]:
        fields = [f.name for f in dataclasses.fields(self) if f.name != "optimizer_grad_buffers"]
        return [(name, getattr(self, name)) for name in fields] + [("peak", self.peak)]


# ---- parameters under the rules table ------------------------------------------------------------


# The params' stacked layer trees (`jaxpar.models.decoder`).
# Multi-token prediction's modules (`mtp`) are routed blocks a training step runs too (`ModelFacts.layers`).
LAYER_STACKS = ("layers", "dense_layers", "mtp")


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter elements per device under the three layouts the step uses."""

    as_params: int  # sharded like the parameters (ZeRO-3: over data too)
    as_optimizer: int  # sharded like the optimizer state (ZeRO >= 1: over data)
    layer_gathered: int  # one layer's weights with ZeRO's split removed (what ZeRO-3 gathers)
    shared: int  # embedding / head / final norm, as parameters
    shared_gathered: int  # the same without ZeRO's split (as the pipeline reduces their gradients)
    total: int  # unsharded
    embedding: int  # the token table, without ZeRO's split
    head: int  # the LM head (0 when tied), without ZeRO's split
    experts: int  # one layer's expert weights, without ZeRO's split (0 for dense)
    # What the optimizer trains (gradients, accumulation carries): every parameter, or with LoRA
    # (`jaxpar.models.lora`) only the adapters, the base being frozen.
    trained_as_params: int = 0
    trained_as_optimizer: int = 0

    def gradients(self, zero_layout: bool) -> int:
        """Trained elements per device, laid out like the optimizer state (ZeRO >= 1) or the params."""
        return self.trained_as_optimizer if zero_layout else self.trained_as_params


def param_counts(layout: Layout) -> ParamCounts:
    """Under the plan's own rules tables (`jaxpar.sharding.rules_table`: where ZeRO, tensor,
    pipeline and expert put each logical name)."""
    return layout.once(_layout_param_counts)


def _layout_param_counts(layout: Layout) -> ParamCounts:
    plan = layout.plan
    params_table = rules_table(plan, zero_on_params=plan.zero.shard_params)
    opt_table = rules_table(plan, zero_on_params=plan.zero.shard_optimizer_state)
    return _param_counts(layout.model_json, tuple(params_table.items()), tuple(opt_table.items()), plan.mesh_shape,
                         tuple(plan.zero.axes))


@functools.lru_cache(maxsize=4096)
def _param_counts(model_json: str, params_items: tuple, opt_items: tuple, mesh_items: tuple, zero: tuple) -> ParamCounts:
    """Cached per (model, tables, mesh, ZeRO's axes), not per plan: the planner's candidates differ
    mostly in knobs (remat, microbatches, schedule) the counts do not read. `zero`: what ZeRO
    splits (data, and with parallel.zero_axes context too)."""
    params_table, opt_table, mesh = dict(params_items), dict(opt_items), dict(mesh_items)
    as_params = as_opt = layer = shared = shared_gathered = total = embedding = head = experts = 0
    leaves = _model_leaves(model_json)
    adapting = any(lora.is_adapter(keys) for keys, _, _ in leaves)
    trained = [0, 0]
    # Layer stacks (`layers`, and `dense_layers` for dense layers among MoE layers): per layer
    # counts are means over all layers, each stack weighted by its share of them.
    stacks = {keys[0]: shape[0] for keys, shape, _ in leaves if keys[0] in LAYER_STACKS}
    for keys, shape, names in leaves:
        total += math.prod(shape)
        here = _shard_elements(shape, names, params_table, mesh)
        as_params += here
        as_opt += _shard_elements(shape, names, opt_table, mesh)
        if not adapting or lora.is_adapter(keys):
            trained[0] += here
            trained[1] += _shard_elements(shape, names, opt_table, mesh)
        if keys[0] in LAYER_STACKS:
            # Per layer: drop the stacked dim (split over pipeline when p > 1) and ZeRO's split.
            one = _shard_elements(shape[1:], names[1:], params_table, mesh, drop=zero)
            if len(stacks) > 1:
                one = one * stacks[keys[0]] / sum(stacks.values())
            layer += one
            experts += one if "experts" in keys else 0
        else:
            shared += here
            whole = _shard_elements(shape, names, params_table, mesh, drop=zero)
            shared_gathered += whole
            embedding += whole if keys[0] == "embed" else 0
            head += whole if keys[0] == "lm_head" else 0
    layer, experts = round(layer), round(experts)
    return ParamCounts(as_params, as_opt, layer, shared, shared_gathered, total, embedding, head, experts, *trained)


# ---- activations ------------------------------------------------------------------------------------


def device_saved_per_token_layer(layout: Layout) -> float:
    """What one layer keeps on the device for the backward, per token: with offload, as much as
    remat full keeps (the layer input); the projection outputs wait in host memory."""
    return saved_per_token_layer(layout, "full" if layout.offloads else None)


def offloaded_bytes_per_step(layout: Layout) -> float:
    """Bytes one device moves to host memory per step under remat offload (and back again for the
    backward): the projection outputs save_dots would keep, every layer and token (0 otherwise)."""
    if not layout.offloads:
        return 0.0
    return layout.layers * layout.tokens * (saved_per_token_layer(layout, "save_dots") - saved_per_token_layer(layout, "full"))


def saved_per_token_layer(layout: Layout, remat: str | None = None, routing: bool = False) -> float:
    """Bytes one decoder layer saves for the backward, per token, on one device (see module doc).

    Splits: heads / ffn over tensor; KV heads over tensor when divisible (else replicated);
    hidden-sized values over tensor along the sequence with sequence parallelism."""
    remat = remat or layout.remat
    t, cb = layout.t, layout.activation_bytes
    ts = t if layout.sequence_parallel else 1
    tk = t if layout.kv_sharded else 1
    D, H, hd, S = layout.hidden, layout.heads, layout.head_dim, layout.seq
    kv = layout.kv_heads * hd / tk
    q = H * hd / t
    mlp = _mlp_saved_per_token(layout, remat, routing)
    if remat == "full":
        return cb * D / ts
    if remat == "save_dots":
        return cb * (q + 2 * kv + D / ts) + mlp
    if remat != "none":
        raise ValueError(f"parallel.remat={remat!r} is not one of ('none', 'full', 'save_dots')")
    # none, per JAX's residual list: 4 hidden-sized values in the compute dtype plus 2 in fp32
    # (RMSNorm works in fp32), q (grouped), k, v, roped q and k, scores and probabilities (one of
    # them fp32), softmax statistics. Flash attention keeps no scores (its statistics instead).
    # QK-norm (Qwen3) keeps q and k before and after their per-head norm, and two fp32
    # statistics per head (JAX's residual list, Qwen3-shaped: +11% over Llama's).
    qk_norm = cb * 2 * (q + kv) + 4 * 2 * (H / t + layout.kv_heads / tk) if layout.facts.qk_norm else 0.0
    if layout.c > 1 or layout.attention_kernel:
        # Context parallelism's kernels and jaxpar's CPU attention (custom VJPs) save their inputs
        # q, k, v, their output and the fp32 log-sum-exp per head; no scores, no softmax statistics.
        return cb * (4 * D / ts + 2 * q + 2 * kv + q) + 4 * (2 * D / ts + H / t + 4 / ts) + mlp + qk_norm
    scores = 0 if layout.flash_attention else H * S / t
    compute = 4 * D / ts + 2 * q + 2 * kv + scores
    fp32 = 2 * D / ts + scores + 2 * H / t + 4 / ts
    return cb * compute + 4 * fp32 + mlp + qk_norm


def _mlp_saved_per_token(layout: Layout, remat: str, routing: bool = False) -> float:
    if layout.is_moe:
        # Per MoE layer the routed experts and the shared expert (a dense MLP); with dense layers
        # among the MoE layers, a mean over the layers (`routing`: a routing layer's).
        moe = layout.facts.moe
        share = 1.0 if routing else moe.layer_share
        routed = (_moe_saved_per_token(layout, remat) + _dense_mlp_saved(layout, remat, moe.shared_ffn)) * share
        return routed + (_dense_mlp_saved(layout, remat, layout.ffn) * (1 - share) if layout.ffn else 0.0)
    return _dense_mlp_saved(layout, remat, layout.ffn)


def _dense_mlp_saved(layout: Layout, remat: str, ffn: int) -> float:
    """A SwiGLU MLP of `ffn` hidden units (0: none)."""
    if not ffn:
        return 0.0
    cb, t = layout.activation_bytes, layout.t
    ts = t if layout.sequence_parallel else 1
    F = ffn / t
    if remat == "none":
        return cb * 6 * F  # gate, up, their activations, the product, and its cotangent's input
    if remat == "save_dots":
        return cb * (2 * F + layout.hidden / ts)  # gate and up outputs, down output
    return 0.0


def moe_rows_per_token(layout: Layout) -> float:
    """Expert-buffer rows one device holds per local token: dropless buffers are sized for the
    worst case, min(k, E/ep) rows per token from each of ep sources; capacity buffers hold
    C = ceil(S·k/E·factor) slots per expert per sequence."""
    E, k, ep = layout.experts, layout.top_k, layout.e
    if layout.capacity_factor > 0:
        capacity = max(1, min(layout.seq, math.ceil(layout.seq * k / E * layout.capacity_factor)))
        return E * capacity / layout.seq
    return ep * min(k, E // ep) if ep > 1 else k


def moe_matmul_rows_per_token(layout: Layout) -> float:
    """Rows the expert matmuls compute per local token. On CPU the dropless path runs
    `grouped_matmul`'s tiled loop over its layout, each expert's rows padded to whole tiles: every
    tile of the layout's static size counts, taken or not (it sits in a `cond`)."""
    rows = moe_rows_per_token(layout)
    if layout.target != "cpu" or layout.capacity_factor > 0:
        return rows
    tokens = layout.tokens / layout.microbatches
    per_layer, groups = int(rows * tokens), layout.experts // layout.e
    return layout_rows(per_layer, groups, group_tile("tiled", per_layer, groups)) / tokens


def _moe_saved_per_token(layout: Layout, remat: str) -> float:
    cb, t, D, E = layout.activation_bytes, layout.t, layout.hidden, layout.experts
    F = layout.expert_ffn / t
    rows = moe_rows_per_token(layout)
    router = 4 * E  # fp32 router logits
    if remat == "none":
        # Per JAX's residual list: six row-sized buffers per dispatched row (received rows,
        # gate / up outputs and activations, outputs), the k outputs gathered back per token,
        # router probabilities and top-k choices.
        # (The tiled layout's padding rows on CPU: the grouped rows, gate, up, their activations
        # and product, per padding row.)
        padding = moe_matmul_rows_per_token(layout) - rows
        return cb * (rows * (2 * D + 4 * F) + padding * (D + 6 * F) + layout.top_k * D) + router + 4 * (2 * layout.top_k + 4)
    if remat == "save_dots":
        if layout.target == "cpu":
            # XLA:CPU's tiled expert loop hides its dots from the remat policy: nothing of the
            # experts is saved but the combined output (measured, Mixtral-shaped, tensor 4).
            return cb * D + router
        # The grouped matmuls' three outputs per computed row, and the combined output.
        return cb * (moe_matmul_rows_per_token(layout) * 3 * F + D) + router
    return 0.0


def _reference_copies(layout: Layout, counts) -> int:
    """2 under DPO without LoRA (the frozen reference copy, sharded like the params: `jaxpar.objective`), else 1."""
    return 2 if objective.settings(layout.config.train) is not None and counts.trained_as_params == counts.as_params else 1


def estimate_memory(layout: Layout) -> MemoryEstimate:
    if layout.p > 1:
        return pipeline_memory(layout)
    counts = param_counts(layout)
    pb, cb = layout.param_bytes, layout.compute_bytes
    params = counts.as_params * pb * _reference_copies(layout, counts)
    optimizer = optimizer_terms(layout).state_bytes
    grads = 4 * counts.gradients(layout.zero.shard_optimizer_state)
    carry, buffers = 0, OPTIMIZER_GRAD_BUFFERS
    if layout.microbatches > 1:
        # The accumulation scan carries the running sum and each microbatch's fresh gradients.
        # Per-replica (and per-rank) accumulation (ZeRO 0/1, dense) keeps them unsharded over data
        # until the one reduction after the loop; plain accumulation (ZeRO-3, MoE) reduces each microbatch
        # into the optimizer's layout (measured: data8 accum4, zero1 accum2 within 3%; MoE zero1
        # data 4 x tensor 2 within 5%). The optimizer phase after the loop holds single copies
        # (measured: Llama-2-7B data 8 accum 2, temp within 0.5%).
        per_replica = layout.gradient in (GradientStrategy.PER_REPLICA, GradientStrategy.PER_RANK)
        carry = 2 * 4 * counts.gradients(not per_replica)
        if per_replica and not layout.zero.shard_optimizer_state and cb != pb:
            # 16-bit compute: the loop's fp32 sum of the 16-bit gradients leaves one more buffer
            # for the optimizer phase (measured, dense data 8 accum 2, bf16: temp 3.82 x the
            # gradients, fp32 2.83; Llama 70B ZeRO-0 data 2-8 accum: 3.73-3.75).
            buffers += 1
        if not per_replica:
            # Plain accumulation: the optimizer phase holds one more gradient-sized buffer (the
            # scan's sum beside the scaled gradients: temp 3.99 x the gradients, 3.09 without
            # accumulation; Mixtral-shaped data 8, and Mixtral 8x7B ZeRO 0 and 3 layouts within
            # 1%). Under ZeRO-1 the backward holds three gradient shards and, with a 16-bit
            # compute dtype, each microbatch's whole gradients in it before their fp32
            # reduce-scatter (fitted: Mixtral 8x7B data 2-8 ZeRO-1 and a 12-layer Mixtral-shaped
            # data 8, temp within 1%; fp32, 4 layers at test size: 10% under).
            buffers += 1
            if layout.zero.gathers_updated_params:
                carry = 3 * 4 * counts.trained_as_optimizer + (counts.as_params * cb if cb != pb else 0)
    micro_tokens = layout.tokens / layout.microbatches  # grad_accum: one microbatch at a time
    stash = layout.layers * micro_tokens * device_saved_per_token_layer(layout)
    param_cast = counts.as_params * cb if cb != pb else 0
    working = _working_set(layout, counts, micro_tokens, layout.layers)
    return MemoryEstimate(
        params=params,
        optimizer=optimizer,
        grads=grads,
        stash=int(stash),
        param_cast=param_cast,
        working=int(working),
        grad_carry=carry,
        optimizer_grad_buffers=buffers,
        optimizer_working=optimizer_terms(layout).working,
    )


def score_bytes_per_token(layout: Layout) -> float:
    """The [S, S] attention buffers one layer saves per token without remat (scores in the
    compute dtype, probabilities in fp32); 0 with flash attention."""
    if layout.attention_kernel:  # saves none, but its backward holds fp32 scores and probabilities
        return layout.heads / layout.t * layout.seq * 8
    if not layout.saves_scores:
        return 0.0
    return layout.heads / layout.t * layout.seq * (layout.activation_bytes + 4)


# Score-block-sized fp32 buffers ([rows, heads, block_q, block_kv]) live in the blockwise
# kernels' backward (scores, probabilities, their gradients, masks): measured 6.1-6.3 on XLA:CPU
# (data 2 x context 4, S 8192, every impl, where they dominate the kernel's extra memory).
SCORE_BLOCK_BUFFERS = 6


def context_attention_buffers(layout: Layout, micro_tokens: float) -> float:
    """What context parallelism's kernel (`parallel/context/local.py`) holds on top of the layer's
    residuals during its backward: `SCORE_BLOCK_BUFFERS` score blocks per head the kernel runs
    (all local heads; Ulysses all_to_all: 1/c of them, on whole sequences), and for all_gather
    the gathered sequence's K or V plus a local block, for ring one local block in flight
    (measured beside the score blocks at data 2 x context 4, S 8192: 10.8 and 2.4 MB against
    8.4 + 2.1 and 2.1 MB counted this way)."""
    if layout.c == 1:
        return 0.0
    c, cb = layout.c, layout.activation_bytes
    hkv = layout.local_kv_heads
    hq = layout.heads // layout.t
    kv_local = micro_tokens * hkv * layout.head_dim  # elements of this device's K (or V) shard
    local = layout.seq // c
    rows = micro_tokens / local
    impl = layout.context_impl
    if impl == "all_to_all":
        block_q = block_kv = chunk_size(layout.seq, layout.plan.context.block)
        heads = hq / c
    else:
        block_q = chunk_size(local, layout.plan.context.block)
        block_kv = chunk_size(layout.seq if impl == "all_gather" else local, layout.plan.context.block)
        heads = hq
    scores = SCORE_BLOCK_BUFFERS * 4 * rows * heads * block_q * block_kv
    blocks = {"all_gather": c + 1, "ring": 1}.get(impl, 0)
    return scores + blocks * kv_local * cb


def _working_set(layout: Layout, counts: ParamCounts, micro_tokens: float, chunk_layers: int) -> float:
    """max(one layer's backward, its attention scores, the loss) for `micro_tokens` tokens at
    once (see module doc)."""
    # The largest layer's backward: a routing one when dense layers sit among MoE layers.
    layer_residuals = micro_tokens * saved_per_token_layer(layout, "none", routing=layout.is_moe)
    factor = MOE_WORKING_FACTOR if layout.is_moe else WORKING_FACTOR[layout.remat]
    score_factor = SCORE_WORKING_FACTOR[layout.remat]
    if chunk_layers == 1:
        factor = score_factor = 0.0  # XLA unrolls a one-layer scan: its residuals are the stash (measured: pp8)
    # The layer's unsharded fp32 weight gradients. (ZeRO-3's re-gathered weights for the
    # recompute do not add to it: measured, data=8 remat full within 2% without them.)
    layer = factor * layer_residuals + 4 * counts.layer_gathered + context_attention_buffers(layout, micro_tokens)
    table_grad = 4 * layout.vocab * layout.hidden / layout.vocab_shards
    scores = score_factor * micro_tokens * score_bytes_per_token(layout)
    loss = LOSS_BUFFERS * 4 * micro_tokens * layout.vocab / layout.vocab_shards
    return max(layer + table_grad, scores, loss)


# ---- pipeline ------------------------------------------------------------------------------------


def pipeline_memory(layout: Layout) -> MemoryEstimate:
    """The pipeline engine per rank (`jaxpar.parallel.pipeline`): layers / p of the state; the
    activation buffers of its scan carry (acts [K_a+1], grads [K_g+1], two in-flight, each
    [mb, S, D] in the compute dtype, mb = rows per microbatch); fp32 gradient accumulators for the
    rank's layers and for the shared (embedding / head) parameters; and one stage backward at a
    time, which recomputes the rank's layers (Lc of them) from the stashed input under the
    configured remat policy. Interleaved and V schedules on natural-order storage also hold the
    rank's layers re-laid into stage order (`comm.jaxpar_quirks`, `Layout.relays_layers`)."""
    counts = param_counts(layout)
    pb, cb = layout.param_bytes, layout.compute_bytes
    plan = layout.pipeline_shape
    mb_tokens = layout.tokens / layout.microbatches
    # The carry holds compute-dtype values (XLA:CPU converts to fp32 only to send them), split
    # over tensor along the sequence with SP.
    act = mb_tokens * layout.hidden * cb / (layout.t if layout.sequence_parallel else 1)
    buffers = (plan.act_slots + 1 + plan.grad_slots + 1 + 2) * act
    if layout.relays_layers:
        buffers += pb * (counts.as_params - counts.shared)  # measured: pipeline 4, v = 2, within 5%
    # The engine's gradients come out whole and are reduced after it: ZeRO-1 does not shrink them
    # (measured: data 2 x pipeline 4, zero 0 and 1 compile to the same temp bytes).
    grads = 4 * counts.gradients(layout.zero.shard_params)
    accumulators = 4 * counts.as_params  # engine carry: layer grads + shared grads, fp32
    chunk_layers = layout.layers // (layout.p * layout.virtual_stages)
    stage = chunk_layers * mb_tokens * device_saved_per_token_layer(layout)
    working = _working_set(layout, counts, mb_tokens, chunk_layers)
    return MemoryEstimate(
        params=counts.as_params * pb * _reference_copies(layout, counts),
        optimizer=optimizer_terms(layout).state_bytes,
        grads=grads,
        stash=int(stage),
        param_cast=counts.as_params * cb if cb != pb else 0,
        working=int(working),
        pipeline_buffers=int(buffers + accumulators),
        # Where AdamW's phase is the peak it holds four gradient-sized buffers beside the
        # engine's (temp 4.0 x the gradients: Llama 3 70B and Mixtral 8x7B pipeline 2-8 with
        # data, context, tensor, ZeRO 0 and 3); ZeRO-1's whole gradients are counted in `grads`.
        optimizer_grad_buffers=OPTIMIZER_GRAD_BUFFERS + (not layout.zero.gathers_updated_params),
        optimizer_working=optimizer_terms(layout).working,
    )
