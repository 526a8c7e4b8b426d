"""gpt-oss trains exactly like one device on every axis (the reversibility rule), as
tests/models/test_families_degeneracy.py proves the other families.

The tiny gpt-oss (tests/support/tiny.py: layers sliding then full with a window of 4, sinks, every
bias, YaRN, 8 experts top-2 with the clamped SwiGLU) runs 3 fp32 steps through the production train
step on a mesh and on one device from the same initial params (`tests/support/reference.py`: step-1
loss and gradients within 1e-5 relative, every step's loss and gradient norm within 1e-4, the
per-expert shares equal). Cases: the experts' biases through the expert dispatch (expert 2 x data 2,
packed documents whose windows restart at each document), tensor + SP (the sinks and q / k / v
biases split with the heads, o's bias after the reduction), and the context ring with a window
(4) shorter than a rank's chunk (8 of 32 tokens over context 2, load-balanced). The pipeline, every
schedule with stages that cut the layer pattern: tests/models/test_pattern_schedules.py.
"""

import math

import numpy as np
import pytest

from tests.support import tiny
from tests.support.reference import assert_matches_reference, packed_batches, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3

# name: (model overrides, train overrides, mesh, parallel overrides, batches)
CASES = {
    "expert2_data2_zero1_packed": ({}, {}, {"expert": 2, "data": 2}, {"zero_stage": 1}, packed_batches),
    "tensor2_data2_sp": ({}, {}, {"tensor": 2, "data": 2}, {"sequence_parallel": True}, synthetic_batches),
    "context2_expert2_ring_window_under_chunk": (
        {}, {"seq_len": 32}, {"context": 2, "expert": 2}, {"context_impl": "ring"}, synthetic_batches,
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", slow_except(CASES, "expert2_data2_zero1_packed"))
def test_matches_single_device(name, shared_cache):
    model, train, mesh, parallel, batches = CASES[name]
    config = tiny.with_overrides(tiny.gpt_oss(train, **model), mesh, parallel=parallel)
    expected = single_device(shared_cache, config, STEPS, batches=batches)
    result = run(config, batches(config, STEPS), math.prod(mesh.values()), expected["init_params"])
    assert_matches_reference(result, expected)
    np.testing.assert_allclose(result["expert_fractions"], expected["expert_fractions"], atol=1e-6)
