"""Qwen3, Qwen3-MoE and Qwen2-MoE train exactly like one device on every axis (the reversibility rule).

Each case runs 3 fp32 steps through the production train step and is compared with the same config
on one device (`tests/support/reference.py`: identical initial params, step-1 loss and gradients within
1e-5 relative, every step's loss and gradient norm within 1e-4, per-expert shares equal). Pipeline
cases are compared with one device accumulating the same microbatches (`grad_accum` = M), as in
tests/parallel/pipeline/test_pipeline_moe.py. Together the cases cover data (ZeRO 0, 1 and 3), tensor + SP, context,
expert with 4 and 8 experts per expert rank, the pipeline (1f1b with uneven stages, interleaved,
zb_h1) with MoE, capacity and dropless dispatch, dense layers among MoE layers, the shared expert,
and loss-free balancing (its router bias identical to one device's after every step, through the
pipeline too). DeepSeek-V3 on every axis, and through the pipeline with its leading dense layer on the
first stage and its multi-token prediction module on the last (1F1B with tensor and SP; DualPipeV, whose
split backward and V put both ends on rank 0), each depth's loss equal to one device's.
"""

import math

import numpy as np
import pytest

from tests.support import tiny
from tests.support.reference import assert_matches_reference, packed_batches, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

STEPS = 3
M = 4  # pipeline microbatches
LOSS_FREE = dict(scoring_func="sigmoid", router_bias_update_rate=0.05)
PIPELINED_DEEPSEEK = dict(first_k_dense_replace=0, num_nextn_predict_layers=0)

# name: (tiny config maker, model overrides, mesh, parallel overrides)
CASES = {
    "qwen3_data2_context2_tensor2_zero3_sp": (
        tiny.qwen3, {}, {"data": 2, "context": 2, "tensor": 2}, {"zero_stage": 3, "sequence_parallel": True},
    ),
    "qwen3_1f1b_p2_data2_tensor2_3layers": (
        tiny.qwen3, {"num_hidden_layers": 3}, {"pipeline": 2, "data": 2, "tensor": 2}, {"zero_stage": 1},
    ),
    # 16 experts over expert 4 (4 per rank) and loss-free balancing.
    "qwen3_moe_data2_expert4_zero1_loss_free": (
        tiny.qwen3_moe, LOSS_FREE, {"data": 2, "expert": 4}, {"zero_stage": 1},
    ),
    "qwen3_moe_data2_expert2_tensor2_zero3_sp_capacity": (
        tiny.qwen3_moe, {"capacity_factor": 1.0}, {"data": 2, "expert": 2, "tensor": 2},
        {"zero_stage": 3, "sequence_parallel": True},
    ),
    "qwen3_moe_interleaved_p2_v2_expert2_4layers_loss_free": (
        tiny.qwen3_moe, {"num_hidden_layers": 4, **LOSS_FREE}, {"pipeline": 2, "expert": 2, "data": 2},
        {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
    ),
    # A dense layer between two MoE layers (the decoder's two stacks); 8 experts per expert rank,
    # the dropless dispatch per (context rank, expert rank).
    "qwen3_moe_dense_layer_context2_expert2_tensor2": (
        tiny.qwen3_moe, {"num_hidden_layers": 3, "mlp_only_layers": [1]}, {"context": 2, "expert": 2, "tensor": 2}, {},
    ),
    "qwen2_moe_data2_expert2_tensor2_zero1_sp": (
        tiny.qwen2_moe, {}, {"data": 2, "expert": 2, "tensor": 2}, {"zero_stage": 1, "sequence_parallel": True},
    ),
    "qwen2_moe_zb_h1_p2_data2_expert2_3layers_capacity": (
        tiny.qwen2_moe, {"num_hidden_layers": 3, "capacity_factor": 1.0}, {"pipeline": 2, "data": 2, "expert": 2},
        {"pipeline_schedule": "zb_h1"},
    ),
    # DeepSeek-V3 (tests/support/tiny.py: MLA, YaRN, a dense layer, 16 experts in 4 groups, one MTP
    # module trained with weight 0.3): MLA's heads and up-projections over tensor, its latents gathered
    # along the sequence under SP; ZeRO-1 and 3; group-limited routing with 4 experts per expert rank
    # and the selection bias moving (loss-free); every context implementation (all_gather moving the
    # latents, also inside pipeline stages, or the expanded K / V); the pipeline with every layer
    # routed and no MTP, and with DeepSeek-V3's own shape (the `*_dense_mtp*` cases below: the dense
    # layer on the first stage, the MTP module and its loss on the last), DualPipeV included.
    "deepseek_v3_data2_tensor2_zero1_sp": (
        tiny.deepseek_v3, {}, {"data": 2, "tensor": 2}, {"zero_stage": 1, "sequence_parallel": True},
    ),
    "deepseek_v3_data2_expert4_zero3_loss_free": (
        tiny.deepseek_v3, LOSS_FREE, {"data": 2, "expert": 4}, {"zero_stage": 3},
    ),
    # all_gather moves MLA's latents (parallel.context_latent, the default) or the expanded K and V.
    "deepseek_v3_context2_tensor2_all_gather_latent": (
        tiny.deepseek_v3, {}, {"context": 2, "tensor": 2}, {"context_impl": "all_gather"},
    ),
    "deepseek_v3_context2_data2_all_gather_expanded": (
        tiny.deepseek_v3, {}, {"context": 2, "data": 2}, {"context_impl": "all_gather", "context_latent": False},
    ),
    "deepseek_v3_1f1b_p2_context2_data2_all_gather_latent": (
        tiny.deepseek_v3, PIPELINED_DEEPSEEK, {"pipeline": 2, "context": 2, "data": 2}, {"context_impl": "all_gather"},
    ),
    "deepseek_v3_context4_data2_ring": (tiny.deepseek_v3, {}, {"context": 4, "data": 2}, {"context_impl": "ring"}),
    "deepseek_v3_context2_data2_expert2_all_to_all": (
        tiny.deepseek_v3, {}, {"context": 2, "data": 2, "expert": 2}, {"context_impl": "all_to_all"},
    ),
    # DeepSeek-V3's own shape through the pipeline: the dense layer on the first stage, the MTP
    # module (and its loss) on the last one, with the whole head there ("ends"). DualPipeV runs the end
    # stages through a split backward (input and weight gradients apart) with both ends on rank 0;
    # 1F1B puts them on two ranks, over tensor 2 with SP. Both train the same model, so they share
    # one one-device reference (6 of 89 CPU s). (Dropped for suite time: ZB-H1 with tensor 2
    # and SP, 66 CPU s against 1F1B's 34: its split backward is DualPipeV's; 1F1B over data 2 x tensor 2
    # with SP and every layer routed, 11 s: the case below has the tensor and SP, the context case
    # above the data axis through the stages; the interleaved case, 33 s: DualPipeV
    # runs two chunks per rank with expert 2 too; DualPipeV with every layer routed, 18 s: the case
    # below routes all but the first.)
    "deepseek_v3_dualpipev_p2_expert2_dense_mtp_5layers_loss_free": (
        tiny.deepseek_v3, {"num_hidden_layers": 5, "router_bias_update_rate": 0.05}, {"pipeline": 2, "expert": 2},
        {"pipeline_vocab": "ends", "pipeline_schedule": "dualpipev"},
    ),
    "deepseek_v3_1f1b_p2_tensor2_dense_mtp_5layers_loss_free_sp": (
        tiny.deepseek_v3, {"num_hidden_layers": 5, "router_bias_update_rate": 0.05}, {"pipeline": 2, "tensor": 2},
        {"pipeline_vocab": "ends", "sequence_parallel": True},
    ),
}


def case_config(name):
    make, model, mesh, parallel = CASES[name]
    if "pipeline" in mesh:
        parallel = {"num_microbatches": M, **parallel}
    return tiny.with_overrides(make(**model), mesh, parallel=parallel), mesh


def reference(shared_cache, config, mesh):
    accum = {"grad_accum": M} if "pipeline" in mesh else {}
    return single_device(shared_cache, tiny.with_overrides(config, {}, train=accum), STEPS)


def router_biases(params):
    return params["layers"]["mlp"]["router_bias"]


@pytest.mark.timeout(300)
# Fast tier: Qwen3 over data, context and tensor, DeepSeek-V3 over data and tensor (the MoE families' fast
# cases: tests/models/test_moe_degeneracy.py; the pipeline's end stages: tests/parallel/pipeline/test_pipeline_ends.py).
@pytest.mark.parametrize("name", slow_except(
    CASES, "qwen3_data2_context2_tensor2_zero3_sp", "deepseek_v3_data2_tensor2_zero1_sp",
))
def test_matches_single_device(name, shared_cache):
    config, mesh = case_config(name)
    expected = reference(shared_cache, config, mesh)
    result = run(config, synthetic_batches(config, STEPS), math.prod(mesh.values()), expected["init_params"])
    assert_matches_reference(result, expected)
    if "expert_fractions" in expected:
        np.testing.assert_allclose(result["expert_fractions"], expected["expert_fractions"], atol=1e-6)
    if config.model.get("num_nextn_predict_layers", 0):
        np.testing.assert_allclose(result["mtp_losses"], expected["mtp_losses"], rtol=1e-4)
    if config.model.get("router_bias_update_rate", 0) > 0:
        bias = router_biases(result["final_params"])
        np.testing.assert_array_equal(bias, router_biases(expected["final_params"]))
        assert np.abs(bias).max() > 0, "the bias should have moved"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepseek_v3_packed_documents_match_single_device(shared_cache):
    """Packed documents (segments, positions restarting, padding) with the multi-token prediction
    module, the sequence split over context (load-balanced: the tokens ahead are taken in text order
    before the split) and the batch over data x expert."""
    mesh = {"context": 2, "data": 2, "expert": 2}
    config = tiny.with_overrides(tiny.deepseek_v3(), mesh, parallel={"context_impl": "all_gather"})
    expected = single_device(shared_cache, config, STEPS, batches=packed_batches)
    result = run(config, packed_batches(config, STEPS), math.prod(mesh.values()), expected["init_params"])
    assert_matches_reference(result, expected)
    np.testing.assert_allclose(result["mtp_losses"], expected["mtp_losses"], rtol=1e-4)
    np.testing.assert_allclose(result["expert_fractions"], expected["expert_fractions"], atol=1e-6)


@pytest.mark.slow
def test_loss_free_bias_moves_toward_balance_and_changes_routing(shared_cache):
    """After each step the bias moves by exactly the rate per expert, up for the experts below the
    layer's mean load and down above it; that changes which experts the next steps choose."""
    config, mesh = case_config("qwen3_moe_data2_expert4_zero1_loss_free")
    with_bias = reference(shared_cache, config, mesh)
    without = single_device(shared_cache, tiny.qwen3_moe(scoring_func="sigmoid"), STEPS)
    assert with_bias["losses"][0] == without["losses"][0], "the bias starts at zero"
    assert not np.array_equal(with_bias["expert_fractions"][1:], without["expert_fractions"][1:])
    bias = router_biases(with_bias["final_params"])  # [layers, experts] after 3 updates
    steps = np.round(bias / LOSS_FREE["router_bias_update_rate"])
    np.testing.assert_allclose(bias, steps * LOSS_FREE["router_bias_update_rate"], atol=1e-7)
    assert np.all(np.abs(steps) <= STEPS)
    assert np.all((bias > 0).any(-1) & (bias < 0).any(-1)), "each layer's bias moves some experts up, some down"


def test_router_bias_update_rule():
    """rate · sign(mean load − load) per layer; loads within the tie tolerance of the mean stay."""
    from jaxpar.models.moe import RouterBias

    load = np.array([[3.0, 1.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0 * (1 + 1e-7)]])
    new = np.asarray(RouterBias.update(np.ones((2, 4), np.float32), load, update_rate=0.5))
    np.testing.assert_array_equal(new, [[0.5, 1.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_router_bias_is_checkpointed_and_restores_onto_another_mesh(tmp_path):
    """The bias is model state: saved with the params and restored bit-identical onto one device
    (from data 2 x expert 4 with ZeRO-1), as its optimizer slots are."""
    import jax

    from jaxpar.checkpoint import Checkpoints, abstract_state
    from jaxpar.train.setup import build
    from tests.support.checkpoint_worker import perturbed

    config, _ = case_config("qwen3_moe_data2_expert4_zero1_loss_free")
    state = perturbed(build(config).init())  # every leaf distinct, the bias no longer zero
    assert np.abs(np.asarray(router_biases(state.params))).min() > 0
    checkpoints = Checkpoints(str(tmp_path), every_steps=1)
    checkpoints.save(1, state, data_state={"step": 1}, config=config.to_json_best_effort())
    checkpoints.wait()
    target = build(tiny.with_overrides(config, {}, parallel={"zero_stage": 0}), jax.devices()[:1])
    restored = checkpoints.restore(None, abstract_state(jax.eval_shape(target.init), target.state_shardings)).state
    checkpoints.close()
    np.testing.assert_array_equal(router_biases(restored.params), router_biases(state.params))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
