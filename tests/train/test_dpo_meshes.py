"""DPO on meshes against one device: two steps of `train.objective="dpo"` (the first with the policy
equal to its reference, the second not) give the same DPO loss, rewards, step-1 gradients and final
parameters on data 2 ZeRO-3 × tensor 2 with 2 microbatches (a dense Llama), on expert 2 (Mixtral,
its load-balancing loss added to the gradient pass), and with LoRA (the reference is the base
without adapters) on context 2 with load balancing (the per-rank gradient path and the permuted
sequence).
"""

import itertools

import jax
import numpy as np
import pytest

from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.dpo import METRICS, dpo_config, preference_batches, run
from tests.support.pipeline_cases import pp
from tests.support.reference import PARAM_L2_RTOL, PARAM_RTOL, l2_relative_error, max_relative_error

CASES = {
    "llama_data2_zero3_tensor2_accum2": (tiny.llama, {"data": 2, "tensor": 2}, {"zero_stage": 3}, {"grad_accum": 2}),
    "mixtral_expert2": (tiny.mixtral, {"expert": 2}, {}, {}),
    "llama_lora_context2": (tiny.llama, {"context": 2}, {}, {"lora": {"rank": 4, "alpha": 8.0}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dpo_on_a_mesh_equals_one_device(case):
    make, mesh, parallel, train = CASES[case]
    train = dict(train)
    lora = train.pop("lora", {"rank": 0})
    single = dpo_config(make())
    single.train.lora.update(lora)
    config = dpo_config(single, **train)
    batches = preference_batches(config.model.vocab_size)
    one = run(single, batches, 1)
    many = run(tiny.with_overrides(config, mesh, parallel=parallel), batches, int(np.prod(list(mesh.values()))), params=one["init"])
    print(case, {k: (one[k], many[k]) for k in ("loss", "rewards_margin")})
    assert one["rewards_margin"][0] == 0 and one["rewards_margin"][1] != 0  # step 1: the policy is its reference
    for key in METRICS:
        np.testing.assert_allclose(many[key], one[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert max_relative_error(many["grads"], one["grads"]) <= 1e-4
    # Adam moves an element with a near-zero step-1 gradient by much of the learning rate (the project's
    # bounds for that: tests/support/reference.py).
    assert max_relative_error(many["final"], one["final"]) <= PARAM_RTOL
    assert l2_relative_error(many["final"], one["final"]) <= PARAM_L2_RTOL


def test_memory_model_prices_the_reference_copy():
    """The analytic memory model's parameter bytes under DPO: the params and the reference copy, as the
    built program's state holds them (data 4 × tensor 2, ZeRO-3; pipeline 2 × data 2 × tensor 2, zb_v);
    with LoRA no copy."""
    from jaxpar.analysis.cost.layout import Layout
    from jaxpar.analysis.cost.memory import estimate_memory
    from jaxpar.train.setup import bytes_per_device

    meshes = (({"data": 4, "tensor": 2}, {"zero_stage": 3}), ({"pipeline": 2, "data": 2, "tensor": 2}, pp("zb_v", 2, 2)))
    for (mesh, parallel), lora in itertools.product(meshes, (0, 4)):
        config = tiny.with_overrides(dpo_config(tiny.llama(num_hidden_layers=4)), mesh, parallel=parallel)
        config.train.lora.update(rank=lora, alpha=8.0)
        program = build(config, jax.devices()[:8])
        state = jax.eval_shape(program.init)
        held = bytes_per_device(state.params, program.state_shardings.params)
        if not lora:
            held += bytes_per_device(state.reference, program.state_shardings.reference)
        assert (state.reference is None) == bool(lora)
        assert estimate_memory(Layout.from_config(config, 8)).params == held
