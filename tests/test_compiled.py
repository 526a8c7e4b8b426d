"""What the compiled programs do, read from their HLO: the communication the design promises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.models.layers import padded_vocab_size
from jaxpar.train.setup import build, bytes_per_device
from tests.hlo import collectives
from tests.reference import with_overrides
from tests.test_degeneracy import tiny_config


def compiled_step(config):
    program = build(config, jax.devices())
    state = jax.eval_shape(program.init)
    batch = jax.ShapeDtypeStruct((config.train.global_batch_size, config.train.seq_len + 1), jnp.int32)
    return program, program.step.lower(state, batch).compile()


def gradient_shapes(program) -> set:
    """Per-device shapes of every parameter gradient, whole and one layer's slice."""
    shapes = set()
    abstract = jax.eval_shape(program.init).params
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(program.state_shardings.params)):
        shard = tuple(sharding.shard_shape(leaf.shape))
        shapes.update({shard, shard[1:]} if len(shard) > 1 else {shard})
    return shapes


def test_grad_accumulation_reduces_gradients_once_per_step():
    config = with_overrides(tiny_config(), {"data": 2, "tensor": 4}, train={"grad_accum": 4})
    program, compiled = compiled_step(config)
    grads = gradient_shapes(program)
    ops = [c for c in collectives(compiled.as_text()) if c.op in ("all-reduce", "reduce-scatter")]
    in_loops = [c for c in ops if c.loop_depth > 0 and grads & set(c.shapes)]
    once = [c for c in ops if c.loop_depth == 0 and grads & set(c.shapes)]
    assert once, "expected the gradient reduction after the accumulation loop"
    assert not in_loops, f"gradient-shaped reductions inside loops: {in_loops}"


def test_vocab_parallel_loss_never_gathers_logits():
    config = with_overrides(tiny_config(), {"data": 2, "tensor": 4})
    _, compiled = compiled_step(config)
    vocab = padded_vocab_size(config.model.vocab_size)
    ops = collectives(compiled.as_text())
    assert ops, "expected collectives in a tensor-parallel step"
    logits_sized = [c for c in ops if any(len(s) >= 3 and s[-1] == vocab for s in c.shapes)]
    assert not logits_sized, f"collectives over [B, S, V] logits: {logits_sized}"


@pytest.mark.parametrize("zero_stage, params_div, opt_div", [(0, 1, 1), (1, 1, 8), (3, 8, 8)])
def test_zero_stages_divide_memory_over_data(zero_stage, params_div, opt_div):
    config = with_overrides(tiny_config(), {"data": 8}, parallel={"zero_stage": zero_stage})
    program = build(config, jax.devices())
    abstract = jax.eval_shape(program.init)
    full = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(models.param_shapes(config.model)))
    params = bytes_per_device(abstract.params, program.state_shardings.params)
    # Norm scales are never sharded (logical name "norm"); everything else splits over data.
    norms = 4 * config.model.hidden_size * (2 * config.model.num_hidden_layers + 1)
    assert params == norms + (full - norms) // params_div
    mu = abstract.opt_state[1][0].mu
    assert bytes_per_device(mu, program.state_shardings.opt_state[1][0].mu) == norms + (full - norms) // opt_div
