"""Gemma 3 trains exactly like one device on every axis (the reversibility rule), as
tests/models/test_families_degeneracy.py proves the other families.

The tiny Gemma 3 (tests/support/tiny.py: layers sliding, sliding, full with a window of 4, two
RoPE bases, QK-norm, four norms per block, GeGLU, the √hidden embedding scale, tied embeddings)
runs 3 fp32 steps through the production train step on a mesh and on one device from the same
initial params (`tests/support/reference.py`: step-1 loss and gradients within 1e-5 relative, every
step's loss and gradient norm within 1e-4). Cases: data 4 with ZeRO-3 over packed documents (each
layer's window leaf and two RoPE rows gathered with its weights); tensor 2 + SP; a 1F1B pipeline whose
uneven stages cut the pattern (1 layer | 2 layers: sliding | sliding + full), with the final logit
soft-cap on, so the pipeline's own embedding lookup (the scale) and vocab-spread head (the cap) are
proven too; the context ring with the window (4) shorter than a rank's chunk (8 of 32 tokens over
context 2, load-balanced).
"""

import math

import pytest

from tests.support import tiny
from tests.support.reference import assert_matches_reference, packed_batches, run, single_device, synthetic_batches

STEPS = 3
M = 4  # pipeline microbatches

# name: (model overrides, train overrides, mesh, parallel overrides, batches)
CASES = {
    "data4_zero3_packed": ({}, {}, {"data": 4}, {"zero_stage": 3}, packed_batches),
    "tensor2_data2_sp": ({}, {}, {"tensor": 2, "data": 2}, {"sequence_parallel": True}, synthetic_batches),
    "1f1b_p2_data2_uneven_softcap": (
        {"final_logit_softcapping": 5.0}, {}, {"pipeline": 2, "data": 2},
        {"num_microbatches": M, "pipeline_stage_layers": "1,2"}, synthetic_batches,
    ),
    "context2_data2_ring_window_under_chunk": (
        {}, {"seq_len": 32}, {"context": 2, "data": 2}, {"context_impl": "ring"}, synthetic_batches,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_single_device(name, shared_cache):
    model, train, mesh, parallel, batches = CASES[name]
    config = tiny.with_overrides(tiny.gemma3_text(train, **model), mesh, parallel=parallel)
    accum = {"grad_accum": M} if "pipeline" in mesh else {}
    expected = single_device(shared_cache, tiny.with_overrides(config, {}, train=accum), STEPS, batches=batches)
    result = run(config, batches(config, STEPS), math.prod(mesh.values()), expected["init_params"])
    assert_matches_reference(result, expected)
