"""The sparse mixture-of-experts MLP every MoE family uses, its router options and auxiliary losses.

A family describes its MoE layer with a `MoESpec` built from its `config.model` (the transformers
names differ: Mixtral's `num_local_experts` / `intermediate_size`, Qwen's `num_experts` /
`moe_intermediate_size`), and names `moe_block(spec_of)` as its MLP hook and
`aux_losses_for(spec_of)` as its record's aux losses. Routing follows transformers: router
logits = x @ router, scores = softmax (or sigmoid) of the logits, top-k, the k weights optionally
renormalised to sum to 1 (`norm_topk_prob`; Mixtral always), then scaled (`MoESpec.routed_scale`,
DeepSeek-V3's `routed_scaling_factor`). Group-limited routing (DeepSeek-V3) keeps each token's
choice within its best groups of experts (`group_limited`). A shared expert is a SwiGLU MLP every
token runs, added; Qwen2-MoE's is scaled by sigmoid(x @ shared_expert_gate), DeepSeek-V3's not. The expert
computation and its expert-parallel dispatch live in `jaxpar.parallel.expert`.

Loss-free load balancing (DeepSeek-V3, whose checkpoints hold the bias as `e_score_correction_bias`
whatever the rate; any MoE family, `router_bias_update_rate` > 0): a per-expert
bias per layer is added to the scores for the top-k choice only (the combine weights are the
unbiased scores), and after each step moves by the rate toward balance: up for experts below the
layer's mean load, down above (`RouterBias.update`). The bias is model state
(`jaxpar.models.state`): its gradient slot carries the layer's observed load (whole-batch
assignment counts), so it is the same on every mesh.

Each layer reports whole-batch router statistics (`MoEBlock.__call__`'s aux); `aux_losses` turns
the stack over layers into the load-balancing loss exactly as transformers'
`load_balancing_loss_func` computes it from the concatenated router logits of all MoE layers
(softmax of the logits, whatever the scoring), plus the router z-loss. Both are functions of
whole-batch sums, so they do not depend on the mesh. With `train.grad_accum` > 1 they are computed
per microbatch (and the step averages them), as in Megatron and in transformers' Trainer. The step
therefore never uses its per-data-replica accumulation for MoE models: a microbatch is the same
rows on every mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.model_facts import expert_capacity
from jaxpar.models.layers import MLP, normal_init
from jaxpar.models.options import RunOptions
from jaxpar.models.state import ObservedState, probe
from jaxpar.parallel.expert import dropped_assignments, moe_ffn, swiglu
from jaxpar.ranges import at_least, one_of

SCORING_FUNCS = ("softmax", "sigmoid")
# Loads within this fraction of the layer's mean count as balanced: the observed loads are sums
# of whole-batch counts times a positive constant whose rounding depends on the mesh, and a tie
# must not move the bias one way on one mesh and the other way on another.
BALANCED = 1e-5


def option_keys() -> dict:
    """jaxpar's own MoE keys (no transformers config has them), with their defaults; every MoE
    family's schema adds them."""
    return dict(
        router_z_loss_coef=0.0,
        # 0: dropless. > 0: each expert takes at most ceil(seq_len * k / E * factor) tokens of each
        # sequence; the rest are dropped (their routed output is zero).
        capacity_factor=0.0,
        # Router scores: "softmax" (transformers' MoE families) or "sigmoid" (DeepSeek-V3).
        scoring_func="softmax",
        # Loss-free load balancing: > 0 adds the per-expert router bias, moved by this much per step.
        router_bias_update_rate=0.0,
    )


def ranges(model, experts_key: str) -> list[str]:
    """The MoE keys' ranges: the family's expert count (`model.<experts_key>`), top-k, the options."""
    experts, top_k = model[experts_key], model.num_experts_per_tok
    errors = at_least(f"model.{experts_key}", experts, 1)
    if not 1 <= top_k <= max(experts, 1):
        errors.append(f"model.num_experts_per_tok={top_k} must be between 1 and model.{experts_key}={experts}")
    return errors + option_ranges(model)


def option_ranges(model) -> list[str]:
    errors = []
    for key in ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
        errors += at_least(f"model.{key}", model[key], 0)
    return errors + one_of("model.scoring_func", model.scoring_func, SCORING_FUNCS)


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer, in transformers-independent terms."""

    experts: int
    top_k: int
    expert_ffn: int  # hidden size of one routed expert
    normalize_top_k: bool  # renormalise the k weights to sum to 1
    shared_ffn: int = 0  # the shared expert's hidden size (0: none)
    capacity_factor: float = 0.0
    scoring: str = "softmax"
    bias_update_rate: float = 0.0  # loss-free balancing (0: no bias)
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    # Group-limited routing (DeepSeek-V3): the experts form `groups` equal groups, a group scores
    # the sum of its two best selection scores, and each token picks its top k among the experts
    # of its `top_groups` best groups only (1, 1: no limit).
    groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0  # the k combine weights are multiplied by this (after renormalising)
    shared_gate: bool = True  # the shared expert is scaled by sigmoid(x @ shared_expert_gate) (Qwen2-MoE)
    selection_bias: bool = False  # the router bias exists even when it is not updated (a checkpoint's own)
    # gpt-oss: a learned bias added to the router logits (a parameter, unlike the selection bias),
    # biases on each expert's gate, up and down projections, and its own gated activation.
    logit_bias: bool = False
    expert_bias: bool = False
    activation: Callable = swiglu  # (x W_gate, x W_up) -> the expert's hidden state


def spec_from(model, *, experts: int, expert_ffn: int, normalize_top_k: bool, shared_ffn: int = 0) -> MoESpec:
    """A family's `MoESpec`: its own sizes, the keys every MoE family names alike
    (`num_experts_per_tok`, `router_aux_loss_coef`) and `option_keys`."""
    return MoESpec(
        experts=experts,
        top_k=model.num_experts_per_tok,
        expert_ffn=expert_ffn,
        normalize_top_k=normalize_top_k,
        shared_ffn=shared_ffn,
        capacity_factor=float(model.capacity_factor),
        scoring=model.scoring_func,
        bias_update_rate=float(model.router_bias_update_rate),
        aux_loss_coef=float(model.router_aux_loss_coef),
        z_loss_coef=float(model.router_z_loss_coef),
    )


class RouterBias(ObservedState):
    """Loss-free balancing's per-expert selection bias of one layer (stacked: [L, E])."""

    @staticmethod
    def update(previous, observation, *, update_rate: float, **metadata):
        """previous + rate · sign(mean load − load), per layer (ties within `BALANCED`: no move)."""
        del metadata
        load = observation.astype(jnp.float32)
        mean = jnp.mean(load, axis=-1, keepdims=True)
        gap = mean - load
        step = jnp.where(jnp.abs(gap) <= BALANCED * mean, 0.0, jnp.sign(gap))
        return previous + update_rate * step


class Experts(nnx.Module):
    """E SwiGLU MLPs stacked on a leading `experts` axis (split over the expert mesh axis); their
    hidden dim is split over `tensor`, as in the dense MLP."""

    def __init__(self, cfg, spec: MoESpec, *, rngs: nnx.Rngs):
        e, d, f, std = spec.experts, cfg.hidden_size, spec.expert_ffn, cfg.initializer_range
        self.gate = nnx.Param(normal_init(rngs, (e, d, f), std), out_sharding=("experts", "embed", "mlp"))
        self.up = nnx.Param(normal_init(rngs, (e, d, f), std), out_sharding=("experts", "embed", "mlp"))
        self.down = nnx.Param(normal_init(rngs, (e, f, d), std), out_sharding=("experts", "mlp", "embed"))
        self.has_bias = spec.expert_bias
        if spec.expert_bias:
            self.gate_bias = nnx.Param(jnp.zeros((e, f), jnp.float32), out_sharding=("experts", "mlp"))
            self.up_bias = nnx.Param(jnp.zeros((e, f), jnp.float32), out_sharding=("experts", "mlp"))
            self.down_bias = nnx.Param(jnp.zeros((e, d), jnp.float32), out_sharding=("experts", "norm"))

    def weights(self) -> tuple:
        """What `moe_ffn` takes: gate, up, down, then the biases when the experts have them."""
        biases = (self.gate_bias[...], self.up_bias[...], self.down_bias[...]) if self.has_bias else ()
        return (self.gate[...], self.up[...], self.down[...]) + biases


class MoEBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, spec_of: Callable):
        self.spec = spec = spec_of(cfg)
        # Every device routes all of its tokens, so the router's expert dim is not split (None).
        self.router = nnx.Param(
            normal_init(rngs, (cfg.hidden_size, spec.experts), cfg.initializer_range), out_sharding=("embed", None)
        )
        if spec.logit_bias:
            self.logit_bias = nnx.Param(normal_init(rngs, (spec.experts,), cfg.initializer_range), out_sharding=(None,))
        self.experts = Experts(cfg, spec, rngs=rngs)
        if has_bias(spec):
            self.router_bias = RouterBias(
                jnp.zeros((spec.experts,), jnp.float32), out_sharding=(None,), update_rate=spec.bias_update_rate
            )
        if spec.shared_ffn:
            self.shared_expert = MLP(cfg, rngs=rngs, ffn=spec.shared_ffn)
        if spec.shared_ffn and spec.shared_gate:
            self.shared_expert_gate = nnx.Param(
                normal_init(rngs, (cfg.hidden_size, 1), cfg.initializer_range), out_sharding=("embed", None)
            )

    def __call__(self, x, opts: RunOptions, real=None):
        """(out [B, S, D], aux): aux holds this layer's whole-batch router statistics over the `real`
        tokens [B, S] (None: all)."""
        spec = self.spec
        with jax.named_scope("moe_router"):
            logits = jnp.einsum("bsd,de->bse", x, self.router[...], preferred_element_type=jnp.float32)
            if spec.logit_bias:
                logits = logits + self.logit_bias[...].astype(jnp.float32)
            logits = checkpoint_name(logits, "router_logits")
            probs = jax.nn.softmax(logits, axis=-1)
            scores = probs if spec.scoring == "softmax" else jax.nn.sigmoid(logits)
            bias = self.router_bias[...].astype(jnp.float32) if has_bias(spec) else None
            select = scores if bias is None else scores + jax.lax.stop_gradient(bias)
            if spec.groups > 1:
                select = group_limited(select, spec.groups, spec.top_groups)
            top_scores, ids, chosen = top_k_by_argmax(select, spec.top_k, values=scores)
            weights = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True) if spec.normalize_top_k else top_scores
            if spec.routed_scale != 1.0:
                weights = weights * spec.routed_scale
        capacity = expert_capacity(x.shape[1], spec.top_k, spec.experts, spec.capacity_factor)
        out = moe_ffn(
            x, ids, weights.astype(x.dtype), self.experts.weights(), num_experts=spec.experts, capacity=capacity,
            rules=opts.rules, activation=spec.activation, fp8=opts.fp8_at("experts"), chunks=opts.plan.expert_chunks,
        )
        if spec.shared_ffn and spec.shared_gate:  # profiled under the dense MLP's scope, "mlp"
            shared, _ = self.shared_expert(x, opts)
            gate = jnp.einsum("bsd,do->bso", x, self.shared_expert_gate[...], preferred_element_type=jnp.float32)
            out = out + (jax.nn.sigmoid(gate) * shared.astype(jnp.float32)).astype(x.dtype)
        elif spec.shared_ffn:
            out = out + self.shared_expert(x, opts)[0]
        stats = router_statistics(logits, probs, chosen, capacity, real)
        if bias is not None:
            stats["load_probe"] = probe(self.router_bias[...], stats["assignments"])
        return out, stats


def has_bias(spec: MoESpec) -> bool:
    """The layer holds a router selection bias (`RouterBias`)."""
    return spec.bias_update_rate > 0 or spec.selection_bias


def group_limited(select, groups: int, top_groups: int):
    """`select` [..., E] with -inf at the experts outside each token's `top_groups` best groups of
    E / `groups` consecutive experts; a group scores the sum of its two best entries (its one, if
    it has one expert), as DeepSeek-V3's node-limited routing (transformers' DeepseekV3TopkRouter)."""
    *lead, experts = select.shape
    size = experts // groups
    best, _, _ = top_k_by_argmax(select.reshape(*lead, groups, size), min(2, size))
    _, _, kept = top_k_by_argmax(jnp.sum(best, axis=-1), top_groups)  # [..., groups]
    return jnp.where(jnp.repeat(kept, size, axis=-1), select, -jnp.inf)


def moe_block(spec_of: Callable):
    """The MLP hook of a MoE family whose `MoESpec` is `spec_of(cfg)`."""
    return functools.partial(MoEBlock, spec_of=spec_of)


def router_statistics(logits, probs, chosen, capacity: int, real=None) -> dict:
    """Sums over the whole batch (the partitioner all-reduces them over data / expert); `chosen`
    [B, S, E] marks each token's k experts. With `real` [B, S] (packed documents) the sums are over
    the real tokens only: padding is routed like any token, but it is not text, and counting it
    would make the load balance of a batch depend on how its documents were packed (transformers'
    `load_balancing_loss_func` leaves padding out the same way, by its attention mask). The dropped
    count stays over every token: padding does take capacity."""
    chosen = jax.lax.stop_gradient(chosen.astype(jnp.float32))
    dropped = dropped_assignments(chosen, capacity)
    z = jax.nn.logsumexp(logits, axis=-1) ** 2
    if real is not None:
        chosen = jnp.where(real[..., None], chosen, 0.0)
        probs = jnp.where(real[..., None], probs, 0.0)
        z = jnp.where(real, z, 0.0)
    return {
        "assignments": jnp.sum(chosen, axis=(0, 1)),  # [E]: (token, expert) pairs routed to each expert
        "router_prob_sum": jnp.sum(probs, axis=(0, 1)),  # [E]
        "router_z_sum": jnp.sum(z),
        "dropped": dropped,
    }


def aux_losses(spec: MoESpec, aux) -> tuple[jnp.ndarray, dict]:
    """(coefficient-weighted aux + z loss, metrics) from `router_statistics` stacked over layers.

    aux_loss = E · Σ_e f_e · P_e over all layers' tokens together, with f_e the fraction of rows
    (token-layers) whose top-k contains e and P_e the mean router probability of e — transformers'
    `load_balancing_loss_func`. z_loss = mean over layers and tokens of logsumexp(logits)².
    Metrics: `expert_fraction` [E] (share of all assignments per expert, sums to 1) and
    `dropped_fraction` (share of assignments dropped by the capacity; 0 when dropless). With
    loss-free balancing the router bias's load probe (exactly zero) is added too.
    """
    assigned = jnp.sum(aux["assignments"], axis=0)  # [E], summed over layers
    # At least one token (k assignments): a microbatch of padding only has no statistics, and gives 0.
    total_assignments = jnp.maximum(jnp.sum(assigned), spec.top_k)
    token_layers = total_assignments / spec.top_k
    tokens_per_expert = assigned / token_layers
    prob_per_expert = jnp.sum(aux["router_prob_sum"], axis=0) / token_layers
    aux_loss = spec.experts * jnp.sum(tokens_per_expert * prob_per_expert)
    z_loss = jnp.sum(aux["router_z_sum"]) / token_layers
    extra = spec.aux_loss_coef * aux_loss + spec.z_loss_coef * z_loss
    if "load_probe" in aux:
        extra = extra + jnp.sum(aux["load_probe"])
    metrics = {
        "aux_loss": aux_loss,
        "z_loss": z_loss,
        "expert_fraction": assigned / total_assignments,
        "dropped_fraction": jnp.sum(aux["dropped"]) / total_assignments,
    }
    return extra, metrics


def aux_losses_for(spec_of: Callable):
    """A MoE family's `Family.aux_losses`: (cfg, aux) -> `aux_losses(spec_of(cfg), aux)`."""
    return lambda cfg, aux: aux_losses(spec_of(cfg), aux)


def top_k_by_argmax(select, k: int, values=None):
    """(values at the top k of `select`, their indices, a [..., E] mask of them), as
    `jax.lax.top_k` over the last axis but by k rounds of argmax (same ties: the lowest index).
    XLA's TopK is a sort custom call its partitioner does not split by batch: with tokens split
    over `data` it all-gathered the router probabilities of every device, forward and in the
    recompute (seen in the tiny Mixtral's data=2 profile); argmax and masking are partitioned
    like any reduction. k passes over [B, S, E]: for Qwen3-MoE's 128 experts, top-8, 8 · 128
    compares per token against its 2 · D · 128 router FLOPs."""
    values = select if values is None else values
    picked, ids = [], []
    remaining = select
    column = jax.lax.broadcasted_iota(jnp.int32, select.shape, select.ndim - 1)
    chosen = jnp.zeros(select.shape, jnp.bool_)
    for _ in range(k):
        best = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        hit = column == best[..., None]
        picked.append(jnp.sum(jnp.where(hit, values, 0.0), axis=-1))
        ids.append(best)
        chosen = chosen | hit
        remaining = jnp.where(hit, -jnp.inf, remaining)
    return jnp.stack(picked, axis=-1), jnp.stack(ids, axis=-1), chosen
