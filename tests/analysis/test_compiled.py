"""What the compiled programs do, read from their HLO: the communication the design promises.

Every structural check first proves, on the same kind of program, that the parser sees what it
looks for (a positive control), so an assertion that something is absent cannot pass vacuously.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import models
from jaxpar.model_facts import padded_vocab_size
from jaxpar.train.setup import build, bytes_per_device
from tests.support import tiny
from tests.support.hlo import collectives
from tests.support.tiers import slow_except


def compiled_step(config, devices=8):
    program = build(config, jax.devices()[:devices])
    state = jax.eval_shape(program.init)
    batch = jax.ShapeDtypeStruct((config.train.global_batch_size, config.train.seq_len + 1), jnp.int32)
    return program, program.step.lower(state, batch).compile()


def parameter_shapes(program) -> set:
    """Per-device shapes of every parameter (and gradient, optimizer-state) shard, whole and one
    layer's slice, under both the parameter and the optimizer-state layouts."""
    shapes = set()
    abstract = jax.eval_shape(program.init).params
    logical = models.logical_axes(program.config.model)
    for rules in (program.rules, program.opt_rules, program.rules.without("data")):
        for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(rules.tree_shardings(logical))):
            shard = tuple(sharding.shard_shape(leaf.shape))
            shapes.update({shard, shard[1:]} if len(shard) > 1 else {shard})
    return shapes


def _squeeze(shape):
    return tuple(d for d in shape if d != 1)


# ---- gradient accumulation: one data-parallel reduction per step -----------------------------


def test_grad_accumulation_reduces_gradients_once_per_step():
    config = tiny.with_overrides(tiny.llama({"grad_accum": 2}), {"data": 2, "tensor": 4})
    program, compiled = compiled_step(config)
    ops = [c for c in collectives(compiled.as_text()) if c.op in ("all-reduce", "reduce-scatter")]
    # Positive control: the tensor-parallel all-reduce of a microbatch's activations
    # [16 / (2 replicas · 2 microbatches), seq, hidden] inside the layer loop.
    activation = (4, config.train.seq_len, config.model.hidden_size)
    assert any(c.loop_depth >= 1 and any(_squeeze(s) == activation for s in c.shapes) for c in ops), ops
    grads = parameter_shapes(program)
    assert activation not in grads
    in_loops = [c for c in ops if c.loop_depth > 0 and grads & {_squeeze(s) for s in c.shapes}]
    once = [c for c in ops if c.loop_depth == 0 and grads & {_squeeze(s) for s in c.shapes}]
    assert once, "expected the gradient reduction after the accumulation loop"
    assert not in_loops, f"gradient-shaped reductions inside loops: {in_loops}"


def _gradient_reductions(program, compiled):
    grads = parameter_shapes(program)
    ops = [c for c in collectives(compiled.as_text()) if c.op in ("all-reduce", "reduce-scatter")]
    in_loops = [c for c in ops if c.loop_depth > 0 and grads & {_squeeze(s) for s in c.shapes}]
    once = [c for c in ops if c.loop_depth == 0 and grads & {_squeeze(s) for s in c.shapes}]
    return in_loops, once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_accumulation_reduces_gradients_once_per_step(monkeypatch):
    """Under context parallelism each microbatch's gradient is a sum over context ranks: the plan's
    per-rank accumulation sums once, after the loop. Positive control: the plain accumulation
    (what the plan chose before) reduces gradient-shaped arrays inside the loops, and K / V are
    all-gathered over context inside them in both programs."""
    from jaxpar.parallel import plan as plan_module
    from jaxpar.parallel.data import GradientStrategy

    config = tiny.with_overrides(
        tiny.llama({"grad_accum": 2}), {"data": 2, "context": 2, "tensor": 2},
        parallel=dict(context_impl="all_gather", zero_stage=1),
    )
    program, compiled = compiled_step(config)
    assert program.plan.gradient is GradientStrategy.PER_RANK
    gathers = [c for c in collectives(compiled.as_text()) if c.op == "all-gather" and c.loop_depth >= 1]
    assert gathers, "expected the context all-gathers of K / V inside the loops"
    in_loops, once = _gradient_reductions(program, compiled)
    assert once, "expected the gradient reduction after the accumulation loop"
    assert not in_loops, f"gradient-shaped reductions inside loops: {in_loops}"

    monkeypatch.setattr(plan_module, "gradient_strategy", lambda **_: GradientStrategy.PLAIN)
    plain, plain_compiled = compiled_step(config)
    assert plain.plan.gradient is GradientStrategy.PLAIN
    assert _gradient_reductions(plain, plain_compiled)[0], "the checker missed per-microbatch gradient reductions"


# ---- the vocab-parallel loss never gathers logits ----------------------------------------------

VOCAB = 1000  # padded to 1024: a size no other dim of these programs has, whole or split by 2 or 4


def logits_like(ops, vocab: int, tensor: int, params: set) -> list:
    """Collectives moving something with a vocab-sized dim (whole or split over tensor) that is
    not a parameter, gradient or optimizer-state shard: [B, S, V] logits, flattened [B·S, V], ..."""
    sizes = {vocab, vocab // tensor}
    return [c for c in ops for s in c.shapes if sizes & set(s) and _squeeze(s) not in params and s not in params]


def test_logit_checker_sees_a_gathered_logits_tensor():
    """Positive control: gathering vocab-sharded logits, as [B, S, V] or flattened [B·S, V], is
    flagged by the same checker the tests below rely on."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    vocab = padded_vocab_size(VOCAB)
    sharded = NamedSharding(mesh, P("data", None, "tensor"))
    for reshape in (lambda x: x, lambda x: x.reshape(-1, x.shape[-1])):
        fn = jax.jit(lambda x: jax.lax.with_sharding_constraint(reshape(x) * 2, NamedSharding(mesh, P())))  # noqa: B023
        text = fn.lower(jax.ShapeDtypeStruct((16, 16, vocab), jnp.float32, sharding=sharded)).compile().as_text()
        assert logits_like(collectives(text), vocab, 4, params=set()), "the checker missed a logits gather"


LOGITS_CASES = {
    "tensor4": ({}, {"data": 2, "tensor": 4}, {}),
    "tensor4_sp": ({}, {"data": 2, "tensor": 4}, {"sequence_parallel": True}),
    "tied_tensor4": ({"tie_word_embeddings": True}, {"data": 2, "tensor": 4}, {}),
    "zero3_tensor4": ({}, {"data": 2, "tensor": 4}, {"zero_stage": 3}),
    "pipeline2_tensor4": ({}, {"pipeline": 2, "tensor": 4}, {"num_microbatches": 2}),
}


@pytest.mark.parametrize("name", slow_except(LOGITS_CASES, "tensor4", "tensor4_sp", "tied_tensor4", "zero3_tensor4"))
def test_vocab_parallel_loss_never_gathers_logits(name):
    model, mesh, parallel = LOGITS_CASES[name]
    config = tiny.with_overrides(tiny.llama(vocab_size=VOCAB, **model), mesh, parallel=parallel)
    program, compiled = compiled_step(config)
    ops = collectives(compiled.as_text())
    vocab = padded_vocab_size(VOCAB)
    # Positive control: the vocab-parallel loss all-reduces [rows, S] statistics over tensor.
    seq = config.train.seq_len
    assert any(c.op == "all-reduce" and any(len(s) == 2 and s[-1] == seq for s in c.shapes) for c in ops), ops
    found = logits_like(ops, vocab, mesh["tensor"], parameter_shapes(program))
    assert not found, f"collectives over logits-like [.., V] tensors: {found}"


# ---- ZeRO divides memory -------------------------------------------------------------------------


@pytest.mark.parametrize("zero_stage, params_div, opt_div", [(0, 1, 1), (1, 1, 8), (3, 8, 8)])
def test_zero_stages_divide_memory_over_data(zero_stage, params_div, opt_div):
    config = tiny.with_overrides(tiny.llama(), {"data": 8}, parallel={"zero_stage": zero_stage})
    program = build(config, jax.devices())
    abstract = jax.eval_shape(program.init)
    full = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(models.param_shapes(config.model)))
    params = bytes_per_device(abstract.params, program.state_shardings.params)
    # Norm scales are never sharded (logical name "norm"); everything else splits over data.
    norms = 4 * config.model.hidden_size * (2 * config.model.num_hidden_layers + 1)
    assert params == norms + (full - norms) // params_div
    mu = abstract.opt_state[1][0].mu
    assert bytes_per_device(mu, program.state_shardings.opt_state[1][0].mu) == norms + (full - norms) // opt_div


@pytest.mark.parametrize("zero_axes, shards", [("auto", 8), ("data", 4)])
def test_zero_over_data_and_context_divides_the_state_by_both(zero_axes, shards):
    """data 4 x context 2: ZeRO-1 over data x context (the default) splits the optimizer state 8
    ways, over data alone 4 ways; the parameters stay whole either way."""
    config = tiny.with_overrides(tiny.llama(), {"data": 4, "context": 2}, parallel={"zero_stage": 1, "zero_axes": zero_axes})
    program = build(config, jax.devices())
    abstract = jax.eval_shape(program.init)
    full = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(models.param_shapes(config.model)))
    norms = 4 * config.model.hidden_size * (2 * config.model.num_hidden_layers + 1)
    assert bytes_per_device(abstract.params, program.state_shardings.params) == full
    mu = abstract.opt_state[1][0].mu
    assert bytes_per_device(mu, program.state_shardings.opt_state[1][0].mu) == norms + (full - norms) // shards


# ---- the HLO reader itself ---------------------------------------------------------------------


def test_reader_finds_collectives_in_conditional_branches_and_loops():
    """Positive control for branch and loop detection: a psum inside a `lax.cond` branch inside a
    `lax.scan`, and one outside both."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def per_device(x):
        def body(carry, _):
            branch = jax.lax.cond(carry[0, 0] > 0, lambda c: jax.lax.psum(c * 3.0, "data"), lambda c: c * 2.0, carry)
            return branch, None

        y, _ = jax.lax.scan(body, x, None, length=3)
        return jax.lax.psum(y, "data")

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    ops = [c for c in collectives(fn.lower(jnp.ones((8, 5))).compile().as_text()) if c.op == "all-reduce"]
    assert any(c.in_branch and c.loop_depth == 1 for c in ops), ops
    assert any(not c.in_branch and c.loop_depth == 0 for c in ops), ops
