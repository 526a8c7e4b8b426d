"""Collective matmul (`parallel.collective_matmul`, issue 39 item 3) against the plain sequence-parallel
path it replaces: the exchanges alone against einsum (values and gradients) on a ring (t = 3) and by
doubling / halving (t = 2, 4, 8); the model's train step equal to the plain step on tensor meshes; the
compiled step holding the permutes the cost model prices and no sequence gathers around the projections;
the combinations it does not support refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.cost.comm_tensor import collective_matmul_permutes
from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.program.hlo import COLLECTIVE_PERMUTE
from jaxpar.parallel.collective_matmul import XLA_GPU_FLAGS, column_parallel, row_parallel
from jaxpar.parallel.tensor import tensor_plan
from jaxpar.sharding import RESIDUAL, Rules
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


def _rules(data: int, tensor: int) -> Rules:
    """Just the logical names these projections use, on a data x tensor mesh (so t need not divide a model)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: data * tensor]).reshape(data, tensor), ("data", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return Rules(mesh, {"batch": ("data",), "act_seq": ("tensor",), "act_embed": (), "seq": (), "embed": (), "heads": ("tensor",),
                        "head_dim": (), "act_heads": ("tensor",)})


# t = 4 by doubling is also the fast tier's train step below; t = 3 takes the ring, t = 8 three levels.
@pytest.mark.parametrize("data, tensor", slow_except([(2, 3), (1, 8), (2, 4), (4, 2)], (2, 3), (1, 8)))
def test_the_exchanges_equal_einsum_values_and_gradients(data, tensor):
    rules = _rules(data, tensor)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(keys[0], (4, 24 * tensor, 16)), rules.sharding(RESIDUAL))
    w = jax.random.normal(keys[1], (16, 2 * tensor, 4)) / 4  # q, k and the output of order 1
    wo = jax.random.normal(keys[2], (2 * tensor, 4, 16)) / (8 * tensor) ** 0.5

    def ours(x, w, wo):
        q, k = column_parallel(x, (w, 2 * w), rules, (W_Q, W_Q), (Q_OUT, Q_OUT))
        return q, row_parallel(q * k, wo, rules, Q_OUT, W_O, contract=2)

    def plain(x, w, wo):
        q, k = jnp.einsum("bsd,dhk->bshk", x, w), jnp.einsum("bsd,dhk->bshk", x, 2 * w)
        return q, jnp.einsum("bshk,hkd->bsd", q * k, wo)

    def values_and_grads(f):
        loss = lambda *a: jnp.sum(jnp.sin(f(*a)[1]))  # noqa: E731
        return lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2))(*a))

    compiled = jax.jit(values_and_grads(ours)).lower(x, w, wo).compile()
    got, want = compiled(x, w, wo), jax.jit(values_and_grads(plain))(x, w, wo)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) < 1e-5
    # Each exchange (two forward, their two transposes) as few permutes as priced: log2 t, or t - 1 on a ring.
    permutes = compiled.as_text().count(" collective-permute(")
    assert permutes == 4 * sum(count for _, count in collective_matmul_permutes(tensor))


def _step(config, devices):
    run = prepare(config, devices)
    compiled = run.program.step_with_grads.lower(run.state, run.batch).compile()
    _, metrics, grads = compiled(run.state, run.batch)
    return metrics, grads, compiled.as_text()


MESHES = {"data2_tensor4": {"data": 2, "tensor": 4}, "context2_tensor2_data2": {"context": 2, "tensor": 2, "data": 2}}


@pytest.mark.parametrize("name", slow_except(MESHES, "data2_tensor4"))
def test_the_train_step_equals_plain_sequence_parallelism(name):
    mesh = MESHES[name]
    (m_plain, g_plain, _), (m_ring, g_ring, text) = (_step(_config(mesh, c, remat="none"), _devices(mesh)) for c in ("none", "permutes"))
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
    config = _config(mesh, "permutes", remat=remat)
    _, _, text = _step(config, _devices(mesh))
    permutes = text.count("collective-permute-start") + text.count(" collective-permute(")
    priced = sum(p.count for p in estimate(config, None, num_devices=8, target="cpu").collectives if p.kind == COLLECTIVE_PERMUTE)
    assert permutes == priced / config.model.num_hidden_layers


@pytest.mark.parametrize("overrides, platform, words", [
    (dict(parallel={"sequence_parallel": False, "collective_matmul": "permutes"}), None, "set parallel.sequence_parallel=True"),
    (dict(parallel={"sequence_parallel": True, "collective_matmul": "permutes"}, train={"fp8": "tensorwise"}), None,
     "train.fp8='tensorwise'"),
    (dict(parallel={"sequence_parallel": True, "collective_matmul": "ring"}), None, "is not one of none, permutes, xla"),
    (dict(parallel={"sequence_parallel": True, "collective_matmul": "xla"}), "gpu", f"needs XLA_FLAGS='{' '.join(XLA_GPU_FLAGS)}'"),
])
def test_unsupported_combinations_are_one_line(overrides, platform, words, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    config = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 2, "tensor": 2}, **overrides)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        check(config, 4, platform)
    assert len(str(e.value).splitlines()) == 1


def test_xla_mode_is_the_plain_path_here_and_accepted_with_its_flags(monkeypatch):
    """'xla' hands the plain sequence-parallel program to XLA: jaxpar's exchanges stay off, and on a GPU
    the config passes once XLA_FLAGS holds the windowed-einsum flags."""
    config = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 2, "tensor": 2},
                                 parallel={"sequence_parallel": True, "collective_matmul": "xla"})
    monkeypatch.setenv("XLA_FLAGS", " ".join(("--xla_force_host_platform_device_count=8", *XLA_GPU_FLAGS)))
    check(config, 4, "gpu")
    check(config, 4, "cpu")
    assert not tensor_plan(config, {"data": 2, "tensor": 2}).collective_matmul
    assert tensor_plan(tiny.with_overrides(config, {"data": 2, "tensor": 2}, parallel={"collective_matmul": "permutes"}),
                       {"data": 2, "tensor": 2}).collective_matmul


def test_an_moe_family_is_refused_in_one_line():
    config = tiny.with_overrides(tiny.mixtral(vocab_size=256), {"data": 2, "tensor": 2},
                                 parallel={"sequence_parallel": True, "collective_matmul": "permutes"})
    with pytest.raises(ConfigError, match="experts or latent attention do not have it yet"):
        check(config, 4)
