"""The MoE dispatch with gpt-oss's experts (gate, up and down biases, the clamped SwiGLU) against a
per-token loop of transformers' `GptOssExperts` math written here in float64: dropless on both
grouped-matmul paths (the tiled one's padded tiles and the ragged one of GPU / TPU, where each row's
expert is read from the group sizes), a capacity that drops, and split over expert 4 x data 2.
"""

import jax
import numpy as np
import pytest

from jaxpar.model_facts import expert_capacity
from jaxpar.models.gpt_oss.schema import ClampedSwiGLU
from jaxpar.parallel.expert import moe_ffn
from jaxpar.train.setup import build
from tests.support import tiny

E, K, B, S, D, F = 8, 2, 8, 12, 16, 24
ALPHA, LIMIT = 1.702, 1.5


def loop_reference(x, ids, weights, experts, capacity):
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    gate, up, down, gate_bias, up_bias, down_bias = (np.asarray(w, np.float64) for w in experts)
    out = np.zeros_like(x)
    for b in range(B):
        used = np.zeros(E, int)
        for s in range(S):
            for j in range(K):
                e = int(ids[b, s, j])
                used[e] += 1
                if capacity and used[e] > capacity:
                    continue
                g = np.minimum(x[b, s] @ gate[e] + gate_bias[e], LIMIT)
                u = np.clip(x[b, s] @ up[e] + up_bias[e], -LIMIT, LIMIT)
                hidden = (u + 1) * g / (1 + np.exp(-ALPHA * g))
                out[b, s] += weights[b, s, j] * (hidden @ down[e] + down_bias[e])
    return out


def random_inputs():
    keys = jax.random.split(jax.random.key(0), 9)
    x = jax.random.normal(keys[0], (B, S, D))
    scores = jax.random.normal(keys[1], (B, S, E)) + np.linspace(0.0, 2.0, E)  # skewed: a small capacity drops
    weights, ids = jax.lax.top_k(jax.nn.softmax(scores), K)
    weights = weights / weights.sum(-1, keepdims=True)
    shapes = [(E, D, F), (E, D, F), (E, F, D), (E, F), (E, F), (E, D)]
    experts = tuple(jax.random.normal(k, shape) * 0.5 for k, shape in zip(keys[3:], shapes))
    return x, ids, weights, experts


# The split case is slow-tier: the fast tier's gpt-oss degeneracy case runs the biases over expert 2.
@pytest.mark.parametrize("mesh", [{}, pytest.param({"data": 2, "expert": 4}, marks=pytest.mark.slow)],
                         ids=["no_mesh", "data2_expert4"])
def test_biased_clamped_experts_match_per_token_loop(mesh):
    x, ids, weights, experts = random_inputs()
    rules = build(tiny.with_overrides(tiny.gpt_oss(), mesh), jax.devices()[:8]).rules if mesh else None
    capacity = expert_capacity(S, K, E, 0.75)
    activation = ClampedSwiGLU(ALPHA, LIMIT)
    for c, impl in ((0, "tiled"), (0, "ragged"), (capacity, None)):
        def fn(x, ids, weights, *experts, c=c, impl=impl):
            return moe_ffn(x, ids, weights, experts, num_experts=E, capacity=c, rules=rules, matmul_impl=impl,
                           activation=activation)

        out = jax.jit(fn)(x, ids, weights, *experts)
        np.testing.assert_allclose(out, loop_reference(x, ids, weights, experts, c), atol=2e-5, rtol=1e-5)
