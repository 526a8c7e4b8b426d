"""The MoE dispatch against a plain per-token loop, and the Mixtral preflight checks.

The loop is the definition: each token's k experts run on it alone, weighted by the router; with
a capacity, an expert takes only the first C (token, expert) pairs of each sequence in token order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.kernels.grouped_matmul import grouped_matmul, grouped_matmul_pair, layout_rows
from jaxpar.model_facts import expert_capacity as capacity_per_expert
from jaxpar.models.mixtral import model_config as mixtral_model_config
from jaxpar.models.mixtral.schema import moe_spec
from jaxpar.models.moe import MoEBlock
from jaxpar.models.options import RunOptions
from jaxpar.parallel.expert import moe_ffn
from jaxpar.train.preflight import ConfigError, check
from jaxpar.train.setup import build
from tests.support import tiny

E, K, B, S, D, F = 8, 2, 8, 12, 16, 24


def loop_reference(x, ids, weights, gate, up, down, capacity):
    x, ids, weights = np.asarray(x, np.float64), np.asarray(ids), np.asarray(weights, np.float64)
    gate, up, down = (np.asarray(w, np.float64) for w in (gate, up, down))
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        used = np.zeros(E, int)
        for s in range(x.shape[1]):
            for j in range(ids.shape[-1]):
                e = ids[b, s, j]
                used[e] += 1
                if capacity and used[e] > capacity:
                    continue
                h = x[b, s] @ gate[e]
                h = h / (1 + np.exp(-h)) * (x[b, s] @ up[e])
                out[b, s] += weights[b, s, j] * (h @ down[e])
    return out


def random_inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (B, S, D))
    # Skewed routing, so that some experts overflow a small capacity.
    scores = jax.random.normal(keys[1], (B, S, E)) + jnp.linspace(0.0, 2.0, E)
    weights, ids = jax.lax.top_k(jax.nn.softmax(scores), K)
    weights = weights / weights.sum(-1, keepdims=True)
    experts = tuple(jax.random.normal(k, shape) * 0.3 for k, shape in zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)]))
    return x, ids, weights, experts


def rules_for(mesh):
    config = tiny.with_overrides(tiny.mixtral(num_local_experts=E), mesh)
    return build(config, jax.devices()[: int(np.prod(list(mesh.values())))]).rules


@pytest.mark.parametrize("mesh", [{}, {"data": 2, "expert": 4}, {"expert": 8}], ids=["no_mesh", "data2_expert4", "expert8"])
def test_dispatch_matches_per_token_loop(mesh):
    x, ids, weights, experts = random_inputs()
    rules = rules_for(mesh) if mesh else None
    capacity = capacity_per_expert(S, K, E, 0.75)
    assert 0 < capacity < S
    # Dropless with both expert matmuls, then a capacity that drops.
    for c, impl in ((0, "tiled"), (0, "ragged"), (capacity, None)):
        fn = jax.jit(lambda *a, c=c, impl=impl: moe_ffn(*a[:3], a[3:], num_experts=E, capacity=c, rules=rules, matmul_impl=impl))
        out = fn(x, ids, weights, *experts)
        np.testing.assert_allclose(out, loop_reference(x, ids, weights, *experts, c), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("sizes", [[5, 0, 12, 3, 0, 20], [0, 150, 0, 0, 130, 0], [0] * 6], ids=["small", "tiles", "empty"])
def test_tiled_grouped_matmul_matches_ragged_dot(sizes):
    """Values and gradients of the tiled loop on its layout (each group padded to whole tiles)
    against `ragged_dot` on the same rows packed; groups empty, one tile, many tiles; the
    layout's padding rows stay zero and get no gradient."""
    tile, rows = 16, 300
    x = jax.random.normal(jax.random.key(0), (rows, 12))
    w = jax.random.normal(jax.random.key(1), (6, 12, 7))
    counts = np.array(sizes)
    padded = -(-counts // tile) * tile
    group = np.repeat(np.arange(6), counts)
    used = len(group)
    slot = (np.cumsum(padded) - padded)[group] + np.arange(used) - (np.cumsum(counts) - counts)[group]
    layout = np.zeros(layout_rows(rows, 6, tile), bool)
    layout[slot] = True

    def tiled(x, w):
        laid_out = jnp.zeros((layout.size, 12)).at[slot].set(x[:used])
        return grouped_matmul(laid_out, w, jnp.asarray(padded, jnp.int32), "tiled", tile)

    def ragged(x, w):
        return jax.lax.ragged_dot(x, w, jnp.asarray(counts, jnp.int32))

    np.testing.assert_allclose(tiled(x, w)[slot], ragged(x, w)[:used], atol=1e-5, rtol=1e-5)
    assert not np.asarray(tiled(x, w)[~layout]).any()
    grads = [
        jax.grad(lambda x, w, f=f, rows=rows: jnp.sum(jnp.sin(f(x, w)[rows])), argnums=(0, 1))(x, w)
        for f, rows in ((tiled, slot), (ragged, slice(0, used)))
    ]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("impl", ["tiled", "ragged"])
@pytest.mark.parametrize("manual", [False, True], ids=["plain", "shard_map"])
def test_grouped_matmul_pair_matches_two_grouped_matmuls(impl, manual):
    """Gate and up as one grouped matmul over interleaved weights: values and gradients equal to
    two separate grouped matmuls; inside shard_map (check_vma) the weights' gradients are summed
    over the manual axis they are replicated on."""
    from jax.sharding import PartitionSpec as P

    x = jax.random.normal(jax.random.key(0), (4 * 40, 12))
    w1, w2 = (jax.random.normal(jax.random.key(i), (6, 12, 7)) for i in (1, 2))
    sizes = jnp.tile(jnp.array([8, 0, 16, 8, 0, 8], jnp.int32), 4)  # per device, the same groups of whole tiles

    def loss(pair):
        def per_device(x, w1, w2, sizes):
            if pair:
                out = grouped_matmul_pair(x, w1, w2, sizes, impl, tile=8)
                a, b = out[..., 0], out[..., 1]
            else:
                a, b = grouped_matmul(x, w1, sizes, impl, tile=8), grouped_matmul(x, w2, sizes, impl, tile=8)
            value = jnp.sum(jnp.sin(a[:40]) * jnp.cos(b[:40]))  # not symmetric in a and b
            return jax.lax.psum(value, "data") if manual else value

        fn = per_device
        if manual:
            mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
            fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")), out_specs=P(), check_vma=True)
        else:
            sizes_one = sizes[:6]
            fn = lambda x, w1, w2, _: per_device(x[:40], w1, w2, sizes_one)  # noqa: E731
        return jax.jit(jax.value_and_grad(lambda x, w1, w2: fn(x, w1, w2, sizes), argnums=(0, 1, 2)))(x, w1, w2)

    (value, grads), (ref_value, ref_grads) = loss(True), loss(False)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_capacity_formula():
    assert capacity_per_expert(16, 2, 8, 0.0) == 0  # dropless
    assert capacity_per_expert(16, 2, 8, 1.0) == 4
    assert capacity_per_expert(16, 2, 8, 1.1) == 5  # ceil
    assert capacity_per_expert(16, 2, 8, 100.0) == 16  # never more than the sequence


def test_router_renormalises_top_k():
    """The k routing weights of every token sum to 1 (transformers' Mixtral renormalises the top-k
    softmax probabilities); checked through the block's output: with every expert the identity
    map's SwiGLU replaced by a constant, the output is the sum of the weights."""
    from flax import nnx

    cfg = mixtral_model_config(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
    with nnx.use_eager_sharding(False):
        block = MoEBlock(cfg, rngs=nnx.Rngs(params=0), spec_of=moe_spec)
    x, *_ = random_inputs()
    out, aux = block(x, RunOptions())
    assert out.shape == x.shape
    np.testing.assert_allclose(aux["assignments"].sum(), B * S * K)
    np.testing.assert_allclose(aux["router_prob_sum"].sum(), B * S, rtol=1e-5)
    # Expert e computes the constant 1 on its first output unit: silu(gate)·up = 1, down picks unit 0.
    big = 30.0  # silu(30) = 30 to float precision; up = 1/30
    block.experts.gate[...] = jnp.zeros((E, D, F)).at[:, 0, 0].set(big)
    block.experts.up[...] = jnp.zeros((E, D, F)).at[:, 0, 0].set(1.0 / big)
    block.experts.down[...] = jnp.zeros((E, F, D)).at[:, 0, 0].set(1.0)
    # Unit 0 is exactly 1 for every token; the other units vary, so tokens route differently.
    inputs = x.at[..., 0].set(1.0)
    out, _ = block(inputs, RunOptions())
    # Each token's output unit 0 is Σ_k weight_k · expert_k(x)[0] ≈ Σ_k weight_k = 1 (not the
    # top-k probabilities' raw sum, which is < 1 with 8 experts).
    np.testing.assert_allclose(out[..., 0], 1.0, rtol=1e-5)
    probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", inputs, block.router[...]), axis=-1)
    raw = jax.lax.top_k(probs, K)[0].sum(-1)
    assert float(raw.max()) < 0.9, "test needs top-k probabilities that do not already sum to 1"


# ---- Preflight ----


def mixtral_config(**model):
    return tiny.mixtral({"seq_len": 32}, vocab_size=256, max_position_embeddings=128, **model)


def only_error(config, devices=8) -> str:
    with pytest.raises(ConfigError) as info:
        check(config, devices)
    lines = str(info.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_valid_mixtral_config_passes():
    c = mixtral_config()
    c.mesh.update(data=2, expert=4)
    assert check(c, 8)["expert"] == 4


def test_experts_not_divisible_by_expert_axis():
    c = mixtral_config(num_local_experts=6)
    c.mesh.update(data=2, expert=4)
    line = only_error(c)
    assert line.startswith("model.num_local_experts=6") and "mesh.expert=4" in line


@pytest.mark.parametrize("top_k", [9, 0])
def test_top_k_out_of_range(top_k):
    c = mixtral_config(num_experts_per_tok=top_k)
    assert only_error(c).startswith(f"model.num_experts_per_tok={top_k}")


def test_negative_capacity_factor():
    assert only_error(mixtral_config(capacity_factor=-1.0)).startswith("model.capacity_factor")


def test_unknown_mixtral_key():
    c = mixtral_config()
    c.model.num_experts = 8  # transformers' alias, not a schema key
    assert only_error(c).startswith("model.num_experts: unknown config key")


def test_tiled_grouped_matmul_gradients_inside_shard_map():
    """With check_vma on, the tiled loop's carries must be typed varying, and the gradient of
    weights replicated over the manual axis summed over it (as JAX does for its own ops)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    x = jax.random.normal(jax.random.key(0), (4 * 40, 12))
    w = jax.random.normal(jax.random.key(1), (6, 12, 7))
    sizes = jnp.tile(jnp.array([5, 0, 12, 3, 0, 20], jnp.int32), 4)  # per device, the same groups

    def loss(impl):
        def per_device(x, w, sizes):
            out = grouped_matmul(x, w, sizes, impl)
            return jax.lax.psum(jnp.sum(jnp.sin(out)), "data")

        fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P(), check_vma=True)
        return jax.jit(jax.grad(lambda x, w: fn(x, w, sizes), argnums=(0, 1)))(x, w)

    for a, b in zip(loss("tiled"), loss("ragged")):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("capacity", [0, 4], ids=["dropless", "capacity"])
def test_bfloat16_gradients_on_expert_mesh(capacity):
    """16-bit compute: the expert weights' gradient is summed over `data` in fp32 (XLA:CPU crashes
    promoting a 16-bit all-reduce) and matches the fp32 gradient to bf16 precision."""
    x, ids, weights, experts = random_inputs()
    rules = rules_for({"data": 2, "expert": 4})

    def grads(dtype):
        def loss(x, *experts):
            out = moe_ffn(x, ids, weights.astype(dtype), experts, num_experts=E, capacity=capacity, rules=rules)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        cast = [a.astype(dtype) for a in (x, *experts)]
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*cast)

    for low, high in zip(grads(jnp.bfloat16), grads(jnp.float32)):
        assert low.dtype == jnp.bfloat16
        np.testing.assert_allclose(low.astype(np.float32), high, atol=0.05 * float(jnp.abs(high).max()))
