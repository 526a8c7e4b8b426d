"""The cost model's pricing of DeepSeek-V3 against what XLA compiles for jaxpar's real train step (as
tests/analysis/test_analysis.py does for the other families; its `check_case` and bounds in
tests/support/analysis_bounds.py): MLA's down-projections run whole on every tensor rank (split over
the sequence under SP, which gathers the latents instead of the layer input), tensor parallelism
reduces the attention's input gradients at the latents, group-limited routing's dispatch, and
multi-token prediction (a routed block, `eh_proj` and the LM head once more per depth; each further
use of the tables reduces its gradient apart on XLA:CPU).

Sizes (fp32): hidden 256, 4 layers (a dense one, then 16 experts of 96 in 4 groups, top-4, a shared
expert), 8 heads (q / k 32 + 16, v 32), q latent 96, kv latent 64, vocab 512, seq 64, batch 16.
"""

from __future__ import annotations

import pytest

from jaxpar.analysis.reports.fidelity import compare
from jaxpar.config import base_config
from jaxpar.models.deepseek_v3 import model_config
from tests.support.fidelity_check import check_case
from tests.support.tiers import slow_except
from tests.support.tiny import with_overrides

MODEL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=128, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
    moe_intermediate_size=96, num_experts_per_tok=4, n_group=4, topk_group=2, num_nextn_predict_layers=0,
)


def deepseek_v3(**model):
    c = base_config()
    c.model = model_config(**{**MODEL, **model})
    c.train.update(global_batch_size=16, seq_len=64, warmup_steps=0)
    c.parallel.remat = "none"
    return c


CASES = {
    "expert4_deepseek_v3": (deepseek_v3(), {"data": 2, "expert": 4}, {}),
    "expert4_deepseek_v3_mtp": (deepseek_v3(num_nextn_predict_layers=1), {"data": 2, "expert": 4}, {}),
    "tensor4_deepseek_v3_mtp": (deepseek_v3(num_nextn_predict_layers=1), {"data": 2, "tensor": 4}, {}),
    "tensor4_sp_deepseek_v3": (deepseek_v3(), {"data": 2, "tensor": 4}, {"sequence_parallel": True}),
    "zero3_remat_full_deepseek_v3": (deepseek_v3(), {"data": 8}, {"zero_stage": 3, "remat": "full"}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", slow_except(CASES))
def test_model_matches_compiled_step(name):
    config, mesh, parallel = CASES[name]
    check_case(name, compare(with_overrides(config, mesh, parallel=parallel)))
