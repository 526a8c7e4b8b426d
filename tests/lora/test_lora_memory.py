"""The analytic memory model prices LoRA: parameters are the base plus the adapters, optimizer state
and gradients the adapters' only — each equal to what the built program's state and shardings
hold (the optimizer state `optax.masked` keeps; the adapters' own gradients)."""

import jax
import pytest

from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.cost.memory import estimate_memory
from jaxpar.models import lora
from jaxpar.train.setup import build, bytes_per_device
from tests.support import tiny


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_lora_state_bytes_match_the_program(zero_stage):
    config = tiny.with_overrides(tiny.llama(dict(lora=dict(rank=4, alpha=8.0))), {"data": 4, "tensor": 2},
                                 parallel={"zero_stage": zero_stage})
    program = build(config, jax.devices())
    state = jax.eval_shape(program.init)
    memory = estimate_memory(Layout.from_config(config, 8))
    assert memory.params == bytes_per_device(state.params, program.state_shardings.params)
    arrays = lambda tree: [x for x in jax.tree.leaves(tree) if x.ndim]  # noqa: E731 (not the step counts)
    shardings = [s for x, s in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(program.state_shardings.opt_state)) if x.ndim]
    assert memory.optimizer == bytes_per_device(arrays(state.opt_state), shardings)
    adapters = {p: x for p, x in lora.adapters_of(state.params).items()}
    opt_shardings = lora.adapters_of(program.opt_rules.tree_shardings(_logical(program)))
    assert memory.grads == bytes_per_device(list(adapters.values()), [opt_shardings[p] for p in adapters])
    full = estimate_memory(Layout.from_config(tiny.with_overrides(tiny.llama(), {"data": 4, "tensor": 2},
                                                                  parallel={"zero_stage": zero_stage}), 8))
    assert memory.optimizer < full.optimizer / 4 and memory.grads < full.grads / 4


def _logical(program):
    from jaxpar import models

    return models.logical_axes(program.model_config)
