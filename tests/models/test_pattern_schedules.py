"""Gemma 3 and gpt-oss train exactly like one device through every pipeline schedule, with stages
that cut the layer pattern (issue 37, item 5).

Both families run at the tiniest shape that still has a pattern to cut: 4 layers of hidden 32,
sequence 16 with a window of 4, the layers sliding, sliding, full, sliding (Gemma 3's
`sliding_window_pattern` 3; gpt-oss's `layer_types` spelled so, rather than its alternation, whose
period 2 even stages would not cut). So 2 + 2 stages put the full layer first on stage 1, and the
interleaved and V-shaped schedules' 4 virtual stages of one layer give rank 0 layers 0 and 2
(interleaved: sliding, full) or 0 and 3 (V: sliding, sliding) and rank 1 the others, in an order
unlike the pattern's. Stages are even so that the engine compiles one copy of each branch (one
per stage length): uneven stages that cut the pattern are Gemma 3's 1F1B case in
tests/models/test_gemma3_degeneracy.py. Every case is compared with the same one-device run
(`tests/support/reference.py`, computed once per family: the parallel section does not enter its
cache key) accumulating the same 4 microbatches: step-1 loss and gradients within 1e-5 relative,
every step's loss and gradient norm within 1e-4.
"""

import pytest

from tests.support import tiny
from tests.support.reference import assert_matches_reference, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3
M = 4  # microbatches: dualpipev takes at least 2p
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_hidden_layers=4)
TRAIN = dict(global_batch_size=8, seq_len=16)
SLIDING, FULL = "sliding_attention", "full_attention"
FAMILIES = {
    "gemma3_text": lambda: tiny.gemma3_text(TRAIN, **SMALL),
    "gpt_oss": lambda: tiny.gpt_oss(TRAIN, **SMALL, num_local_experts=4, layer_types=[SLIDING, SLIDING, FULL, SLIDING]),
}
# schedule: its virtual stages per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zb_v": 2, "dualpipev": 2}
CASES = [(family, schedule) for family in FAMILIES for schedule in SCHEDULES]


def case_config(family, schedule):
    parallel = dict(pipeline_schedule=schedule, num_microbatches=M, virtual_stages=SCHEDULES[schedule])
    return tiny.with_overrides(FAMILIES[family](), {"pipeline": 2}, parallel=parallel)


@pytest.mark.timeout(300)
# Fast tier: multi-layer stages (Gemma 3, 1F1B) and layers stored in the schedule's order (gpt-oss, interleaved).
@pytest.mark.parametrize("family, schedule", slow_except(CASES, ("gemma3_text", "1f1b"), ("gpt_oss", "interleaved_1f1b")))
def test_matches_single_device(family, schedule, shared_cache):
    config = case_config(family, schedule)
    expected = single_device(shared_cache, tiny.with_overrides(config, {}, train={"grad_accum": M}), STEPS)
    result = run(config, synthetic_batches(config, STEPS), 2, expected["init_params"])
    assert_matches_reference(result, expected)
