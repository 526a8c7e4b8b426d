"""Every optimizer on every mesh trains exactly like one device (the reversibility rule).

AdamW's matrix is tests/parallel/test_degeneracy.py and the pipeline / context / MoE suites; here Adafactor,
Lion, Muon and SGD each run three layouts that together cover every axis, 3 fp32 steps each,
against the same config on one device (one shared reference per optimizer and model):
identical initial params, step-1 loss and gradients within 1e-5 relative, every step's loss and
gradient norm within 1e-4, the parameters after the last step (`tests/support/reference.py`).

- Mixtral on data 2 × expert 2 × tensor 2 with SP and ZeRO-1: optimizer state split over data and
  tensor; Muon gathers whole matrices over both and keeps the experts as batch dims (no gather);
  Adafactor's factored moments split like the dims they keep.
- data 2 × context 2 × tensor 2 with ZeRO-3: parameters split over data too.
- pipeline 2 × data 2 × tensor 2 (1F1B, 2 microbatches): the layer stacks over pipeline.
Pipeline and expert meet in tests/parallel/pipeline/test_pipeline_moe.py (AdamW); an optimizer sees each axis as a
split of its parameters' dims, and each dim's split is covered here.
"""

import math

import pytest

from tests.support import tiny
from tests.support.reference import assert_matches_reference, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3
# Learning rates at which 3 steps visibly lower the loss; Adafactor factors the tiny matrices.
OPTIMIZERS = {
    "adafactor": {"optimizer": "adafactor", "adafactor": {"min_dim_to_factor": 16}, "learning_rate": 5e-2},
    "lion": {"optimizer": "lion", "learning_rate": 3e-3},
    "muon": {"optimizer": "muon"},
    "sgd": {"optimizer": "sgd", "sgd": {"nesterov": True}, "learning_rate": 0.5},
}
MICROBATCHES = 2
# name: (family, mesh, parallel, train overrides of the one-device reference)
LAYOUTS = {
    "mixtral_data2_expert2_tensor2_sp_zero1": (
        "mixtral", {"data": 2, "expert": 2, "tensor": 2}, {"zero_stage": 1, "sequence_parallel": True}, {},
    ),
    "data2_context2_tensor2_zero3": ("llama", {"data": 2, "context": 2, "tensor": 2}, {"zero_stage": 3}, {}),
    "pipeline2_data2_tensor2": (
        "llama", {"pipeline": 2, "data": 2, "tensor": 2}, {"pipeline_schedule": "1f1b", "num_microbatches": MICROBATCHES}, {},
    ),
}


def reference(shared_cache, family, train):
    result = single_device(shared_cache, getattr(tiny, family)(train), STEPS)
    assert result["losses"][-1] < result["losses"][0] - 0.02, f"{train}: the one-device run must train"
    return result


@pytest.mark.timeout(300)
# Fast tier: every optimizer on the pipeline layout (data x tensor inside its stages).
@pytest.mark.parametrize("layout", slow_except(LAYOUTS, "pipeline2_data2_tensor2"))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_matches_single_device(optimizer, layout, shared_cache):
    family, mesh, parallel, reference_train = LAYOUTS[layout]
    train = OPTIMIZERS[optimizer]
    expected = reference(shared_cache, family, {**train, **reference_train})
    config = tiny.with_overrides(getattr(tiny, family)(train), mesh, parallel=parallel)
    assert_matches_reference(run(config, synthetic_batches(config, STEPS), math.prod(mesh.values()), expected["init_params"]), expected)
