"""Training FLOPs per step, counted the way the shared peer benchmark counts them."""

import math

import jax

from jaxpar import models


def active_matmul_params(model_config) -> int:
    """Parameters touched by each token, excluding the input embedding (a lookup, not a matmul).
    For MoE, expert weights count k/E of their size (only k of E experts run per token)."""
    shapes = models.param_shapes(model_config)
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        keys = [getattr(k, "key", str(k)) for k in path]
        if keys[0] == "embed":
            continue
        size = math.prod(leaf.shape)
        if "experts" in keys:
            size = size * model_config.num_experts_per_tok // model_config.num_local_experts
        total += size
    if model_config.tie_word_embeddings:  # the tied table is also the LM head matmul
        total += math.prod(shapes["embed"]["weight"].shape)
    return total


def train_flops_per_step(model_config, batch: int, seq: int) -> float:
    """6·N·T for the matmuls plus causal attention 6·L·T·S·D (QKᵀ and PV, forward + backward)."""
    tokens = batch * seq
    attention = 6 * model_config.num_hidden_layers * tokens * seq * model_config.hidden_size
    return 6 * active_matmul_params(model_config) * tokens + attention
