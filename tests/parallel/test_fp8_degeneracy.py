"""FP8 on 8 emulated devices against FP8 on one device (`train.fp8`), 3 steps of the production step.

Not bitwise, and not within the fp32 tolerances of tests/parallel/test_degeneracy.py: another
layout sums in another order, and a ~1e-7 fp32 difference that moves a value across the midpoint
between two FP8 neighbours rounds it one FP8 step (2^-3 of the value for e4m3) the other way. Such
flips are rare and scattered, so the step-1 gradients agree in norm (measured ≤ 3e-4 relative over
the cases below) while a wrong scale — an amax that is not reduced over every device holding part
of the tensor — moves whole tensors by up to 2^-4 (planted: ≥ 1e-2). Losses and gradient norms are
compared at every step. A pipeline's microbatches are quantized one by one, so it is compared with
one device accumulating the same microbatches (`train.grad_accum` = microbatches: the same rows).
"""

import jax
import pytest

from tests.support import tiny
from tests.support.reference import l2_relative_error, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3
GRAD_L2_RTOL, LOSS_RTOL = 2e-3, 1e-3

# name: (recipe, config builder, mesh, parallel, one-device grad_accum)
CASES = {
    "delayed_data2_tensor4_sp": ("delayed", tiny.llama, {"data": 2, "tensor": 4}, {"sequence_parallel": True}, 1),
    "tensorwise_data2_tensor4_sp": ("tensorwise", tiny.llama, {"data": 2, "tensor": 4}, {"sequence_parallel": True}, 1),
    "rowwise_data8": ("rowwise", tiny.llama, {"data": 8}, {}, 1),
    "tensorwise_pipeline2_data2_tensor2": (
        "tensorwise", lambda t: tiny.llama(t, num_hidden_layers=4), {"pipeline": 2, "data": 2, "tensor": 2},
        {"num_microbatches": 2}, 2,
    ),
    # Delayed scaling's histories staged with their layers; each records the microbatches' mean amax.
    "delayed_pipeline2_data2_tensor2": (
        "delayed", lambda t: tiny.llama(t, num_hidden_layers=4), {"pipeline": 2, "data": 2, "tensor": 2},
        {"num_microbatches": 2}, 2,
    ),
    # The experts' matmuls inside the expert shard_map (dropless and capacity): amaxes pmax'd there.
    "rowwise_expert2_data2_tensor2": ("rowwise", tiny.mixtral, {"data": 2, "expert": 2, "tensor": 2}, {}, 1),
    "tensorwise_expert4_data2": ("tensorwise", tiny.mixtral, {"data": 2, "expert": 4}, {}, 1),
    "tensorwise_expert2_capacity_data2_tensor2": (
        "tensorwise", lambda t: tiny.mixtral(t, capacity_factor=1.5), {"data": 2, "expert": 2, "tensor": 2}, {}, 1,
    ),
}


@pytest.mark.parametrize("name", slow_except(CASES, "delayed_data2_tensor4_sp"))
def test_fp8_matches_single_device(name, shared_cache):
    recipe, make, mesh, parallel, accum = CASES[name]
    one = make({"fp8": recipe, "grad_accum": accum})
    reference = single_device(shared_cache, one, STEPS)
    config = tiny.with_overrides(make({"fp8": recipe}), mesh, parallel=parallel)
    result = run(config, synthetic_batches(config, STEPS), 8, reference["init_params"])
    for a, b in zip(jax.tree.leaves(result["init_params"]), jax.tree.leaves(reference["init_params"])):
        assert (a == b).all()
    err = l2_relative_error(result["grads1"], reference["grads1"])
    assert err <= GRAD_L2_RTOL, f"step-1 gradients differ from one device by {err:.2e} in norm"
    for key in ("losses", "grad_norms"):
        gap = abs(result[key] - reference[key]) / abs(reference[key])
        assert gap.max() <= LOSS_RTOL, f"{key} differ from one device by {gap.max():.2e}"
