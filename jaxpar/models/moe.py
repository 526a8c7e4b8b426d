"""The sparse mixture-of-experts MLP (Mixtral's `block_sparse_moe`) and its auxiliary losses.

Routing follows transformers' Mixtral: router logits = x @ router, softmax over experts, top-k,
the k weights renormalised to sum to 1. The expert computation and its expert-parallel dispatch
live in `jaxpar.parallel.expert`.

Each layer reports whole-batch router statistics (`MoEBlock.__call__`'s aux); `aux_losses`
turns the stack over layers into the load-balancing loss exactly as transformers'
`load_balancing_loss_func` computes it from the concatenated router logits of all layers, plus
the router z-loss. Both are functions of whole-batch sums, so they do not depend on the mesh.
With `train.grad_accum` > 1 they are computed per microbatch (and the step averages them),
as in Megatron and in transformers' Trainer. The step therefore never uses its per-data-replica
accumulation for MoE models: a microbatch is the same rows on every mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from jaxpar.models.layers import normal_init
from jaxpar.models.options import RunOptions
from jaxpar.model_facts import expert_capacity
from jaxpar.parallel.expert import dropped_assignments, moe_ffn


class Experts(nnx.Module):
    """`num_local_experts` SwiGLU MLPs stacked on a leading `experts` axis (split over the expert
    mesh axis); their hidden dim is split over `tensor`, as in the dense MLP."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        e, d, f, std = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range
        self.gate = nnx.Param(normal_init(rngs, (e, d, f), std), out_sharding=("experts", "embed", "mlp"))
        self.up = nnx.Param(normal_init(rngs, (e, d, f), std), out_sharding=("experts", "embed", "mlp"))
        self.down = nnx.Param(normal_init(rngs, (e, f, d), std), out_sharding=("experts", "mlp", "embed"))


class MoEBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.num_experts, self.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.capacity_factor = cfg.capacity_factor
        # Every device routes all of its tokens, so the router's expert dim is not split (None).
        self.router = nnx.Param(
            normal_init(rngs, (cfg.hidden_size, self.num_experts), cfg.initializer_range), out_sharding=("embed", None)
        )
        self.experts = Experts(cfg, rngs=rngs)

    def __call__(self, x, opts: RunOptions):
        """(out [B, S, D], aux): aux holds this layer's whole-batch router statistics."""
        with jax.named_scope("moe_router"):
            logits = jnp.einsum("bsd,de->bse", x, self.router[...], preferred_element_type=jnp.float32)
            logits = checkpoint_name(logits, "router_logits")
            probs = jax.nn.softmax(logits, axis=-1)
            top_probs, ids = top_k_by_argmax(probs, self.top_k)
            weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        capacity = expert_capacity(x.shape[1], self.top_k, self.num_experts, self.capacity_factor)
        experts = (self.experts.gate[...], self.experts.up[...], self.experts.down[...])
        out = moe_ffn(
            x, ids, weights.astype(x.dtype), experts, num_experts=self.num_experts, capacity=capacity, rules=opts.rules
        )
        return out, router_statistics(logits, probs, ids, self.num_experts, capacity)


def router_statistics(logits, probs, ids, num_experts: int, capacity: int) -> dict:
    """Sums over the whole batch (the partitioner all-reduces them over data / expert)."""
    assigned = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=(0, 1, 2)))
    return {
        "assignments": assigned,  # [E]: (token, expert) pairs routed to each expert
        "router_prob_sum": jnp.sum(probs, axis=(0, 1)),  # [E]
        "router_z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "dropped": dropped_assignments(ids, num_experts, capacity),
    }


def aux_losses(cfg, aux) -> tuple[jnp.ndarray, dict]:
    """(coefficient-weighted aux + z loss, metrics) from `router_statistics` stacked over layers.

    aux_loss = E · Σ_e f_e · P_e over all layers' tokens together, with f_e the fraction of rows
    (token-layers) whose top-k contains e and P_e the mean router probability of e — transformers'
    `load_balancing_loss_func`. z_loss = mean over layers and tokens of logsumexp(logits)².
    Metrics: `expert_fraction` [E] (share of all assignments per expert, sums to 1) and
    `dropped_fraction` (share of assignments dropped by the capacity; 0 when dropless).
    """
    assigned = jnp.sum(aux["assignments"], axis=0)  # [E], summed over layers
    total_assignments = jnp.sum(assigned)
    token_layers = total_assignments / cfg.num_experts_per_tok
    tokens_per_expert = assigned / token_layers
    prob_per_expert = jnp.sum(aux["router_prob_sum"], axis=0) / token_layers
    aux_loss = cfg.num_local_experts * jnp.sum(tokens_per_expert * prob_per_expert)
    z_loss = jnp.sum(aux["router_z_sum"]) / token_layers
    extra = cfg.router_aux_loss_coef * aux_loss + cfg.router_z_loss_coef * z_loss
    metrics = {
        "aux_loss": aux_loss,
        "z_loss": z_loss,
        "expert_fraction": assigned / total_assignments,
        "dropped_fraction": jnp.sum(aux["dropped"]) / total_assignments,
    }
    return extra, metrics


def top_k_by_argmax(probs, k: int):
    """`jax.lax.top_k` over the last axis as k rounds of argmax (same ties: the lowest index).
    XLA's TopK is a sort custom call its partitioner does not split by batch: with tokens split
    over `data` it all-gathered the router probabilities of every device, forward and in the
    recompute (seen in the tiny Mixtral's data=2 profile); argmax and masking are partitioned
    like any reduction. k is small (experts per token), so k passes over [B, S, E] are cheap."""
    picked, ids = [], []
    remaining = probs
    column = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    for _ in range(k):
        best = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        hit = column == best[..., None]
        picked.append(jnp.sum(jnp.where(hit, probs, 0.0), axis=-1))
        ids.append(best)
        remaining = jnp.where(hit, -jnp.inf, remaining)
    return jnp.stack(picked, axis=-1), jnp.stack(ids, axis=-1)

