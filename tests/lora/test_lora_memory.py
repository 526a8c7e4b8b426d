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


def test_planner_header_says_only_the_adapters_train():
    """The plan's state line: 18 B per parameter for full fine-tuning of a bf16-compute model, and
    for LoRA the frozen base's bytes with the adapters' gradients and moments named."""
    from jaxpar.analysis.cost import hardware
    from jaxpar.analysis.planner.plan_text import header

    full = tiny.llama(dict(compute_dtype="bfloat16"))
    adapted = tiny.llama(dict(compute_dtype="bfloat16", lora=dict(rank=16, alpha=32.0, targets="q,v")))
    h100 = hardware.PROFILES["h100-80g"]
    assert "state: 18 B per parameter (float32 parameters 4 + AdamW moments 8 + fp32 gradients 4 + bfloat16 copy 2)" in header(
        full, h100, 8)
    assert ("state: LoRA rank 16 on q,v: the base frozen (float32 parameters 4, bfloat16 copy 2), gradients and AdamW "
            "moments of the adapters only") in header(adapted, h100, 8)
