"""A tiny Llama with gpt-oss's attention pattern trains exactly like one device on every axis.

The model is a test double, `llama_patterned` (tests/support/patterned_family.py): Llama's decoder
with `PatternedDecoder` and the shared pattern keys, 4 layers alternating sliding (window 4: shorter
than the 16-token sequence and than a rank's 8 tokens at context 2, as long as a rank's 4 tokens at
context 4, longer than the load-balanced chunks of 2 there) and full attention, learned sinks,
soft-capped logits and Gemma's query scale. Each case runs 3 fp32 steps of the production train step
and is compared with the same config on one device (`tests/support/reference.py`): context
parallelism (2 and 4 ranks, every implementation, packed documents), tensor (sinks sharded with the
heads), data with ZeRO-3 and with full remat, and the pipeline with stages that cut the pattern
(3 + 1 layers with context 2; interleaved, one layer per virtual stage; Gemma 3 and gpt-oss on
every schedule: tests/models/test_pattern_schedules.py). The
one-device run itself is checked against plain Llama where the pattern is the identity (windows past
the sequence, no sinks, no cap).
"""

import math

import numpy as np
import pytest

from jaxpar.models import families
from tests.support import tiny
from tests.support.patterned_family import FAMILY, NAME, schema
from tests.support.reference import assert_matches_reference, packed_batches, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3
M = 4  # pipeline microbatches
PATTERN = dict(
    num_hidden_layers=4, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
    attention_sinks=True, attn_logit_softcapping=8.0, query_pre_attn_scalar=12.0,
)


@pytest.fixture(autouse=True)
def patterned_family(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, NAME, FAMILY)


def patterned(**model):
    config = tiny.llama(**(PATTERN | model))
    config.model = schema(**config.model.to_dict() | {"model_type": NAME})
    return config


# name: (model overrides, mesh, parallel overrides, packed documents)
CASES = {
    **{
        f"context{c}_{impl}": ({}, {"context": c}, {"context_impl": impl}, True)
        for c in (2, 4) for impl in ("all_gather", "ring", "all_to_all")
    },
    "context2_tensor2_ring_sp": ({}, {"context": 2, "tensor": 2}, {"context_impl": "ring", "sequence_parallel": True}, True),
    "data2_tensor2_zero3": ({}, {"data": 2, "tensor": 2}, {"zero_stage": 3}, True),
    # 2 KV heads over tensor 4: repeated, so each rank's 2 query heads (and their sinks) meet a copy.
    "tensor4_jaxpar_xla": ({}, {"tensor": 4}, {"attention_impl": "jaxpar_xla"}, True),
    "jaxpar_xla_data2": ({}, {"data": 2}, {"attention_impl": "jaxpar_xla"}, True),
    "data2_remat_full": ({}, {"data": 2}, {"remat": "full"}, True),
    "interleaved_p2_v2_data2": ({}, {"pipeline": 2, "data": 2},
                                {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}, True),
    "1f1b_p2_uneven_context2_all_gather": (
        {}, {"pipeline": 2, "context": 2}, {"pipeline_stage_layers": [3, 1], "context_impl": "all_gather"}, True,
    ),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", slow_except(CASES, "context2_ring"))
def test_matches_single_device(name, shared_cache):
    model, mesh, parallel, packed = CASES[name]
    if "pipeline" in mesh:
        parallel = {"num_microbatches": M, **parallel}
    config = tiny.with_overrides(patterned(**model), mesh, parallel=parallel)
    batches = packed_batches if packed else synthetic_batches
    accum = {"grad_accum": M} if "pipeline" in mesh else {}
    expected = single_device(shared_cache, tiny.with_overrides(config, {}, train=accum), STEPS, batches=batches)
    result = run(config, batches(config, STEPS), math.prod(mesh.values()), expected["init_params"])
    assert_matches_reference(result, expected)
    windows = result["final_params"]["layers"]["attention"]["window"]
    np.testing.assert_array_equal(windows, [[4], [0], [4], [0]])  # never trained, staged back in layer order


def test_identity_pattern_is_llama():
    """Windows past the sequence, no sinks, no cap, the default scale: Llama's losses and gradients."""
    identity = dict(sliding_window=64, layer_types=["sliding_attention", "full_attention"], attention_sinks=False,
                    attn_logit_softcapping=None, query_pre_attn_scalar=None, num_hidden_layers=2)
    config, ours = tiny.llama(), patterned(**identity)
    base = run(config, synthetic_batches(config, 2), 1)
    params = dict(base["init_params"])
    params["layers"] = {**params["layers"], "attention": {**params["layers"]["attention"], "window": np.array([[64], [0]], np.float32)}}
    got = run(ours, synthetic_batches(ours, 2), 1, params)
    np.testing.assert_allclose(got["losses"], base["losses"], rtol=1e-6)
    for path in (("layers", "attention", "q"), ("embed", "weight")):
        g, b = got["grads1"], base["grads1"]
        for key in path:
            g, b = g[key], b[key]
        np.testing.assert_allclose(g, b, rtol=1e-5, atol=1e-8)
