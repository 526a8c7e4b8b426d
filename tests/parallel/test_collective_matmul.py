"""Collective matmul (`parallel.collective_matmul`, issue 39 item 3) against the plain sequence-parallel
path it replaces: the rings alone against einsum (values and gradients); the model's train step equal
to the plain step on tensor meshes; the compiled step holding the permutes the cost model prices and no
sequence gathers around the projections; the combinations it does not support refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.program.hlo import COLLECTIVE_PERMUTE
from jaxpar.parallel.collective_matmul import column_parallel, row_parallel
from jaxpar.sharding import RESIDUAL
from jaxpar.train.harness import prepare
from jaxpar.train.preflight import ConfigError, check
from tests.support import tiny
from tests.support.tiers import slow_except

Q_OUT = ("batch", "seq", "act_heads", "head_dim")
W_Q, W_O = ("embed", "heads", "head_dim"), ("heads", "head_dim", "embed")


def _config(mesh, collective, **parallel):
    return tiny.with_overrides(tiny.llama(vocab_size=256), mesh,
                               parallel={"sequence_parallel": True, "collective_matmul": collective, **parallel})


def _devices(mesh):
    return jax.devices()[: int(np.prod(list(mesh.values())))]


def test_the_rings_equal_einsum_values_and_gradients():
    mesh = {"data": 2, "tensor": 4}
    rules = prepare(_config(mesh, True), _devices(mesh)).program.rules
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(keys[0], (4, 32, 16)), rules.sharding(RESIDUAL))
    w, wo = jax.random.normal(keys[1], (16, 8, 4)), jax.random.normal(keys[2], (8, 4, 16))

    def ours(x, w, wo):
        (q,) = column_parallel(x, (w,), rules, (W_Q,), (Q_OUT,))
        return q, row_parallel(q, wo, rules, Q_OUT, W_O, contract=2)

    def plain(x, w, wo):
        q = jnp.einsum("bsd,dhk->bshk", x, w)
        return q, jnp.einsum("bshk,hkd->bsd", q, wo)

    for got, want in zip(jax.jit(ours)(x, w, wo), plain(x, w, wo)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)[1]))  # noqa: E731
    got, want = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(x, w, wo), jax.grad(loss(plain), argnums=(0, 1, 2))(x, w, wo)
    for g, r in zip(got, want):
        assert float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) < 1e-5


def _step(config, devices):
    run = prepare(config, devices)
    compiled = run.program.step_with_grads.lower(run.state, run.batch).compile()
    _, metrics, grads = compiled(run.state, run.batch)
    return metrics, grads, compiled.as_text()


MESHES = {"data2_tensor4": {"data": 2, "tensor": 4}, "context2_tensor2_data2": {"context": 2, "tensor": 2, "data": 2}}


@pytest.mark.parametrize("name", slow_except(MESHES, "data2_tensor4"))
def test_the_train_step_equals_plain_sequence_parallelism(name):
    mesh = MESHES[name]
    (m_plain, g_plain, _), (m_ring, g_ring, text) = (_step(_config(mesh, c, remat="none"), _devices(mesh)) for c in (False, True))
    assert float(m_ring["loss"]) == pytest.approx(float(m_plain["loss"]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_ring)):
        assert float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30)) < 1e-5
    assert text.count("collective-permute") > 0


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "save_dots", "full"])
def test_the_compiled_step_holds_the_priced_permutes(remat):
    """Per layer (the scan body, counted once) the permutes the cost model prices, and no sequence
    all-gather left around the projections (the step keeps only the LM head's and the embedding's)."""
    mesh = {"data": 2, "tensor": 4}
    config = _config(mesh, True, remat=remat)
    _, _, text = _step(config, _devices(mesh))
    permutes = text.count("collective-permute-start") + text.count(" collective-permute(")
    priced = sum(p.count for p in estimate(config, None, num_devices=8, target="cpu").collectives if p.kind == COLLECTIVE_PERMUTE)
    assert permutes == priced / config.model.num_hidden_layers


@pytest.mark.parametrize("overrides, words", [
    (dict(parallel={"sequence_parallel": False, "collective_matmul": True}), "set parallel.sequence_parallel=True"),
    (dict(parallel={"sequence_parallel": True, "collective_matmul": True}, train={"fp8": "tensorwise"}), "train.fp8='tensorwise'"),
])
def test_unsupported_combinations_are_one_line(overrides, words):
    config = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 2, "tensor": 2}, **overrides)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        check(config, 4)
    assert len(str(e.value).splitlines()) == 1


def test_an_moe_family_is_refused_in_one_line():
    config = tiny.with_overrides(tiny.mixtral(vocab_size=256), {"data": 2, "tensor": 2},
                                 parallel={"sequence_parallel": True, "collective_matmul": True})
    with pytest.raises(ConfigError, match="experts or latent attention do not have it yet"):
        check(config, 4)
