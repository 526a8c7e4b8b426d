"""`scripts/bench.py moe`'s contenders do the same work: for every MoE shape (Qwen3-MoE's, and
DeepSeek-V3's MLA with group-limited routing and a shared expert) the dense twin's model FLOPs per step
are the MoE model's within half a dense MLP unit, counted independently of the bench: from the
parameter trees the two modules build (routed experts at k / E, the embedding lookup left out) and the
causal-attention term of the peer convention."""

import math

import jax
import pytest

from jaxpar import models
from jaxpar.bench.moe import SHAPE, SHAPES, configs


def active_params(model) -> float:
    shapes = models.param_shapes(model)
    top_k = model.num_experts_per_tok if "num_experts_per_tok" in model else 1
    experts = model.get("num_experts") or model.get("n_routed_experts") or 1
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        keys = [getattr(k, "key", str(k)) for k in path]
        if keys[0] == "embed" and not model.tie_word_embeddings:
            continue
        total += math.prod(leaf.shape) * (top_k / experts if "experts" in keys else 1)
    return total


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_dense_twin_does_the_moe_models_work(shape):
    moe, dense = configs(256, 8, 64, shape)
    unit = 3 * SHAPE["hidden_size"] * SHAPE["num_hidden_layers"]  # parameters of one dense MLP unit
    assert abs(active_params(moe.model) - active_params(dense.model)) <= unit / 2
    tokens = moe.train.global_batch_size * moe.train.seq_len
    flops = [models.facts(c.model).model_flops_per_step(moe.train.global_batch_size, moe.train.seq_len) for c in (moe, dense)]
    assert abs(flops[0] - flops[1]) <= 6 * tokens * unit / 2
