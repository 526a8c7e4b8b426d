"""Mixtral through the pipeline trains exactly like one device, router losses included.

The pipelined step computes the load-balancing and z losses per microbatch from that microbatch's
router statistics over all layers (accumulated beside the activations, `parallel/pipeline/
router.py`) and averages them — as the non-pipelined step does with `train.grad_accum` = m over
the same rows. So each case is compared with one device running `grad_accum` = m: 3 fp32 steps,
identical initial params, step-1 loss and gradients within 1e-5 relative, every step's loss and
gradient norm within 1e-4, and the per-expert token shares equal. Cases: 1f1b (uneven stages) and
interleaved, each with expert parallelism and data or tensor; and pipeline × context × expert
together. zb_h1 with capacity-mode experts is tests/models/test_families_degeneracy.py's Qwen2-MoE case
(the same mesh, plus a shared expert).
"""

import math

import numpy as np
import pytest

from jaxpar.mesh import resolve_mesh_shape
from jaxpar.parallel.pipeline.options import checks as pipeline_checks
from tests.support import tiny
from tests.support.reference import assert_matches_reference, max_relative_error, run, single_device, synthetic_batches

STEPS = 3
M = 4  # microbatches

# name: (model overrides, mesh, parallel). Only 1f1b runs an uneven (auto) split: compile time
# grows with the distinct stage lengths, and uneven interleaving is covered by test_pipeline.py.
CASES = {
    "1f1b_p2_data2_expert2_3layers": (
        {"num_hidden_layers": 3}, {"pipeline": 2, "data": 2, "expert": 2}, {"pipeline_schedule": "1f1b"}
    ),
    "interleaved_p2_v2_expert2_tensor2_4layers": (
        {"num_hidden_layers": 4}, {"pipeline": 2, "expert": 2, "tensor": 2},
        {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
    ),
    # All three explicit axes at once: the sequence split over context inside the stages, the
    # dropless dispatch per (context rank, expert rank).
    "1f1b_p2_context2_expert2": (
        {"num_hidden_layers": 4}, {"pipeline": 2, "context": 2, "expert": 2}, {"pipeline_schedule": "1f1b"}
    ),
}


def reference(shared_cache, config):
    """One device, the same microbatches as gradient accumulation."""
    return single_device(shared_cache, tiny.with_overrides(config, {}, train={"grad_accum": M}), STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(name, shared_cache):
    model, mesh, parallel = CASES[name]
    config = tiny.with_overrides(tiny.mixtral(**model), mesh, parallel={"num_microbatches": M, **parallel})
    devices = math.prod(mesh.values())
    assert pipeline_checks(config, resolve_mesh_shape(config.mesh, devices), has_aux_losses=True) == []
    expected = reference(shared_cache, config)
    result = run(config, synthetic_batches(config, STEPS), devices, expected["init_params"])
    assert_matches_reference(result, expected)
    np.testing.assert_allclose(result["expert_fractions"], expected["expert_fractions"], atol=1e-6)
    if name.startswith("1f1b"):
        # The comparison can tell: router losses over the whole batch (grad_accum 1) give a loss
        # and gradients the per-microbatch reference's tolerances reject.
        whole = single_device(shared_cache, config, STEPS)
        assert abs(whole["losses"][0] - expected["losses"][0]) > 1e-5 * abs(expected["losses"][0])
        assert max_relative_error(whole["grads1"], expected["grads1"]) > 1e-3  # measured 9e-2


def test_preflight_refuses_zero3_moe_pipeline():
    config = tiny.with_overrides(tiny.mixtral(), {"pipeline": 2, "data": 2}, parallel={"zero_stage": 3})
    (error,) = pipeline_checks(config, resolve_mesh_shape(config.mesh, 4), has_aux_losses=True)
    assert error.startswith("parallel.zero_stage=3 with mesh.pipeline=2")
