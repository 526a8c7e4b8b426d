"""`parallel.expert_overlap` (issue 39 item 4): each device's rows dispatched to the experts in two
independent chunks. Held to: the train step equal to the plain one on expert meshes; the compiled
program's dependency graph, where no all-to-all of one chunk depends on, or is needed by, the other
chunk's all-to-alls or the expert work between them (the plain program's form one chain); the
all-to-alls the cost model prices, doubled at half the bytes; the preflight's one-line refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.program.hlo import ALL_TO_ALL, parse_computations
from jaxpar.parallel.expert import moe_ffn
from jaxpar.train.harness import prepare
from jaxpar.train.preflight import ConfigError, check
from tests.support import tiny
from tests.support.tiers import slow_except


def _config(mesh, overlap, **train):
    return tiny.with_overrides(tiny.mixtral(vocab_size=256), mesh, parallel={"expert_overlap": overlap, "remat": "none"},
                               **({"train": train} if train else {}))


def _devices(mesh):
    return jax.devices()[: int(np.prod(list(mesh.values())))]


MESHES = {"data2_expert2": {"data": 2, "expert": 2}, "expert4_data2": {"expert": 4, "data": 2}}


@pytest.mark.parametrize("name", slow_except(MESHES, "data2_expert2"))
def test_the_train_step_equals_the_plain_one_and_its_all_to_alls_are_priced(name):
    mesh = MESHES[name]
    out = {}
    for overlap in (False, True):
        config = _config(mesh, overlap)
        run = prepare(config, _devices(mesh))
        compiled = run.program.step_with_grads.lower(run.state, run.batch).compile()
        _, metrics, grads = compiled(run.state, run.batch)
        text = compiled.as_text()
        priced = sum(p.count for p in estimate(config, None, num_devices=len(_devices(mesh)), target="cpu").collectives
                     if p.kind == ALL_TO_ALL)
        out[overlap] = (float(metrics["loss"]), grads, text.count(" all-to-all("), priced / config.model.num_hidden_layers)
    (loss, grads, hlo, priced), (loss2, grads2, hlo2, priced2) = out[False], out[True]
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        assert float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30)) < 1e-5
    # Per layer (the scan body, once): dispatch, return and counts, forward and backward; twice over in chunks.
    assert (hlo, hlo2) == (priced, priced2) and hlo2 == 2 * hlo


def _reach(comp):
    """name -> every instruction of `comp` it depends on (transitively)."""
    operands = {i.name: [o for o in i.operand_names] for i in comp.instructions}
    memo = {}

    def ancestors(name):
        if name not in memo:
            memo[name] = set()
            for o in operands.get(name, ()):
                memo[name] |= {o} | ancestors(o)
        return memo[name]

    return {name: ancestors(name) for name in operands}


def _exchange_chains(chunks):
    """The forward MoE block compiled on data 2 x expert 2: its all-to-alls grouped into chains (two
    all-to-alls in one chain when one depends on the other), and each chain's expert work (every
    instruction on a path from its first all-to-all to its last)."""
    rules = prepare(_config(MESHES["data2_expert2"], chunks > 1), _devices(MESHES["data2_expert2"])).program.rules
    b, s, d, f, e, k = 8, 16, 32, 64, 4, 2
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (b, s, d))
    ids = jax.random.randint(keys[1], (b, s, k), 0, e)
    weights = jax.nn.softmax(jax.random.normal(keys[2], (b, s, k)))
    experts = tuple(jax.random.normal(key, shape) for key, shape in zip(keys[3:], ((e, d, f), (e, d, f), (e, f, d))))
    fn = jax.jit(lambda x, ids, w, *ex: moe_ffn(x, ids, w, ex, num_experts=e, capacity=0, rules=rules, chunks=chunks))
    (comp,) = [c for c in parse_computations(fn.lower(x, ids, weights, *experts).compile().as_text()).values()
               if any(i.opcode == "all-to-all" for i in c.instructions)]
    reach = _reach(comp)
    a2a = [i.name for i in comp.instructions if i.opcode == "all-to-all"]
    chains = []
    for name in a2a:
        linked = [c for c in chains if any(name in reach[o] or o in reach[name] for o in c)]
        merged = {name}.union(*linked)
        chains = [c for c in chains if c not in linked] + [merged]
    work = []
    for chain in chains:
        first = [n for n in chain if not (reach[n] & chain)]
        last = [n for n in chain if not any(n in reach[o] for o in chain)]
        work.append({n for n in reach if any(f in reach[n] for f in first) and any(n in reach[t] for t in last)})
    return chains, work, reach


def test_each_chunks_exchange_is_independent_of_the_other_chunks_work():
    plain, _, _ = _exchange_chains(1)
    assert len(plain) == 1, "without chunks every all-to-all waits on the one before"
    chains, work, reach = _exchange_chains(2)
    assert len(chains) == 2 and all(len(c) == 3 for c in chains)  # counts, dispatch and return per chunk
    for mine, other in ((0, 1), (1, 0)):
        assert work[mine], "the expert work between a chunk's dispatch and return"
        for node in work[mine]:
            for a2a in chains[other]:
                assert node not in reach[a2a] and a2a not in reach[node], (node, a2a)


@pytest.mark.parametrize("mesh, train, words", [
    ({"data": 2, "expert": 2}, {"global_batch_size": 4}, "it holds 1 per microbatch"),
    ({"pipeline": 2, "expert": 2}, {}, "not supported with mesh.pipeline > 1"),
])
def test_what_it_cannot_split_is_one_line(mesh, train, words):
    with pytest.raises(ConfigError, match=words) as error:
        check(_config(mesh, True, **train), int(np.prod(list(mesh.values()))))
    assert len(str(error.value).splitlines()) == 1
