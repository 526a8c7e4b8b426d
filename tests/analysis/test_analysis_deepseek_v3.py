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

from jaxpar.analysis.cost.cost_model import flops_per_device
from jaxpar.analysis.program.hlo import ALL_GATHER, REDUCE_SCATTER
from jaxpar.analysis.reports.fidelity import compare
from jaxpar.config import base_config
from jaxpar.models.deepseek_v3 import model_config
from tests.support.analysis_bounds import BOUNDS
from tests.support.fidelity_check import check_case
from tests.support.tiers import slow_except
from tests.support.tiny import with_overrides

MODEL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=128, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
    moe_intermediate_size=96, num_experts_per_tok=4, n_group=4, topk_group=2, num_nextn_predict_layers=0,
)


def deepseek_v3(seq: int = 64, **model):
    c = base_config()
    c.model = model_config(**{**MODEL, **model})
    c.train.update(global_batch_size=16, seq_len=seq, warmup_steps=0)
    c.parallel.remat = "none"
    return c


# (expert 4 without MTP was dropped for suite time, 30 s: the MTP case below prices the same experts.)
CASES = {
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


# all_gather context parallelism moving MLA's latents (`parallel.context_latent`, the default), or the
# expanded K and V; seq 128, 64 tokens of each row per device.
CONTEXT_CASES = {
    "context2_latent_deepseek_v3": (deepseek_v3(seq=128), {"data": 4, "context": 2}, {"context_impl": "all_gather"}),
    "context2_expanded_deepseek_v3": (
        deepseek_v3(seq=128), {"data": 4, "context": 2}, {"context_impl": "all_gather", "context_latent": False},
    ),
}


@pytest.fixture(scope="module")
def context_fidelity():
    found = {}

    def get(name):
        if name not in found:
            config, mesh, parallel = CONTEXT_CASES[name]
            found[name] = compare(with_overrides(config, mesh, parallel=parallel))
        return found[name]

    return get


def exchange_bytes(fidelity, priced: bool) -> float:
    """Wire bytes per device over context of the attention exchange (all-gathers and reduce-scatters;
    the gradients' all-reduce over context is the same for both paths)."""
    if priced:
        rows = [p for p in fidelity.estimate.collectives if p.axes == ("context",) and p.kind in (ALL_GATHER, REDUCE_SCATTER)]
        return sum(p.wire_bytes(fidelity.estimate.layout.mesh) for p in rows)
    return sum(t.wire_bytes for t in fidelity.compiled_totals() if t.axes == ("context",) and t.kind in (ALL_GATHER, REDUCE_SCATTER))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CONTEXT_CASES))
def test_context_matches_compiled_step(name, context_fidelity):
    fidelity = context_fidelity(name)
    # As tests/analysis/test_analysis.py's context cases: the HLO count takes both branches of each
    # masked-pair skip, so FLOPs are compared priced without the skip.
    check_case(name, fidelity, flops=False)
    every_pair = flops_per_device(fidelity.estimate.layout, skip_masked=False)
    assert every_pair == pytest.approx(fidelity.compiled.hlo_matmul_flops, rel=BOUNDS[name].flops), fidelity.table()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gathering_latents_moves_what_the_model_says(context_fidelity):
    """The compiled programs' exchange over context: the latents (kv_lora_rank + qk_rope_head_dim = 80
    numbers per token) against K and V (8 heads x 48 each, padded), both priced within 10%; the latent
    path moves about a tenth of the bytes for 2 x (c - 1) / c more up-projection FLOPs."""
    latent, expanded = context_fidelity("context2_latent_deepseek_v3"), context_fidelity("context2_expanded_deepseek_v3")
    moved = {name: exchange_bytes(f, priced=False) for name, f in (("latent", latent), ("expanded", expanded))}
    priced = {name: exchange_bytes(f, priced=True) for name, f in (("latent", latent), ("expanded", expanded))}
    print(f"context exchange per device: latent {moved['latent'] / 1e6:.3f} MB (priced {priced['latent'] / 1e6:.3f}), "
          f"expanded {moved['expanded'] / 1e6:.3f} MB (priced {priced['expanded'] / 1e6:.3f})")
    for name in moved:
        assert priced[name] == pytest.approx(moved[name], rel=0.15), name
    assert moved["latent"] < moved["expanded"] / 5
    assert latent.compiled.hlo_matmul_flops > expanded.compiled.hlo_matmul_flops
