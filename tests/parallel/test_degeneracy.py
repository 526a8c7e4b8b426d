"""The reversibility rule: every parallel layout trains exactly like one device.

Each case runs 3 fp32 steps of the production train step on 8 emulated CPU devices and is
compared with the same config on one device: identical initial params, step-1 loss and gradients
within 1e-5 relative, every step's loss and gradient norm within 1e-4, the same learning rates,
and the parameters after the last step (`tests/support/reference.py` says how close, and why).
The tiny model has 2 KV heads (fewer than tensor = 4 or 8: replicated) and vocab 250 (padded to
256). bf16 compute is compared with the one-device bf16 run over 5 steps.
Packed documents (`PACKED_CASES`: segment ids, positions restarting per document, padding) go
through the meshes that cut or regroup them, against one device on the same packed batches (one
reference for all: no accumulation, no parallel settings). tests/data/test_packed.py proves step 1 of a
packed batch equals its documents run alone; these run 3 steps of different packings through the
optimizer (ZeRO-3's sharded update, the pipeline's microbatches, context chunks).
"""

import copy
import math
import re

import jax
import numpy as np
import pytest

from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.reference import (
    assert_matches_reference,
    packed_batches,
    run,
    single_device,
    synthetic_batches,
)
from tests.support.tiers import slow_except

STEPS = 3

# name: (model overrides, train overrides, mesh, parallel)
CASES = {
    "data8": ({}, {}, {"data": 8}, {}),
    "tensor2": ({}, {}, {"data": 4, "tensor": 2}, {}),
    "tensor4": ({}, {}, {"data": 2, "tensor": 4}, {}),
    "tensor4_sp_remat_full": ({}, {}, {"data": 2, "tensor": 4}, {"sequence_parallel": True, "remat": "full"}),
    "tensor8_sp": ({}, {}, {"tensor": 8}, {"sequence_parallel": True}),
    "tensor2_sp_accum2": ({}, {"grad_accum": 2}, {"data": 4, "tensor": 2}, {"sequence_parallel": True}),
    "zero1_accum2": ({}, {"grad_accum": 2}, {"data": 4, "tensor": 2}, {"zero_stage": 1}),
    "zero3_accum2": ({}, {"grad_accum": 2}, {"data": 8}, {"zero_stage": 3}),
    "zero3_tensor2_sp_remat_dots": (
        {}, {}, {"data": 4, "tensor": 2}, {"zero_stage": 3, "sequence_parallel": True, "remat": "save_dots"}
    ),
    "expert_as_data_accum2": ({}, {"grad_accum": 2}, {"data": 2, "expert": 4}, {}),
    "expert_data_tensor_zero1": ({}, {}, {"data": 2, "expert": 2, "tensor": 2}, {"zero_stage": 1}),
    # Tied embeddings: the one table is the vocab-parallel embedding and the LM head.
    "tied_tensor4": ({"tie_word_embeddings": True}, {}, {"data": 2, "tensor": 4}, {}),
    # ZeRO over data x context (`parallel.zero_axes`, "auto" with mesh.context > 1): the optimizer
    # state (and at stage 3 the parameters) split over both, with and without per-rank accumulation.
    "zero1_data_x_context": ({}, {}, {"data": 4, "context": 2}, {"zero_stage": 1}),
    "zero1_data_x_context_accum2": ({}, {"grad_accum": 2}, {"data": 2, "context": 2, "tensor": 2}, {"zero_stage": 1}),
    "zero3_data_x_context_tensor2_sp": (
        {}, {}, {"data": 2, "context": 2, "tensor": 2}, {"zero_stage": 3, "sequence_parallel": True, "remat": "full"}
    ),
    # One KV head under tensor 4: every tensor rank gets a copy.
    "one_kv_head_tensor4": ({"num_key_value_heads": 1}, {}, {"data": 2, "tensor": 4}, {}),
    # Without sequence parallelism the sequence need not divide by tensor.
    "seq15_tensor4": ({}, {"seq_len": 15}, {"data": 2, "tensor": 4}, {}),
}


# Fast tier: one case each for data, tensor + SP + ZeRO-3, expert-as-data and ZeRO over data x context.
@pytest.mark.parametrize("name", slow_except(CASES, "data8", "zero3_tensor2_sp_remat_dots", "expert_data_tensor_zero1",
                                              "zero1_data_x_context"))
def test_matches_single_device(name, shared_cache):
    model, train, mesh, parallel = CASES[name]
    config = tiny.with_overrides(tiny.llama(train, **model), mesh, parallel=parallel)
    reference = single_device(shared_cache, config, STEPS)
    result = run(config, synthetic_batches(config, STEPS), math.prod(mesh.values()), reference["init_params"])
    assert_matches_reference(result, reference)


# name: (train overrides, mesh, parallel). Documents of 2 .. 9 tokens in rows of 17.
PACKED_CASES = {
    # Load balancing: chunks of 4 tokens, rank r holds chunks r and 3-r, so documents straddle
    # chunks and ranks; sequence parallelism splits them again over `tensor`.
    "packed_c2_balanced_tensor2_sp_data2": ({}, {"context": 2, "tensor": 2, "data": 2}, {"sequence_parallel": True}),
    # 4 microbatches of 2 rows, each with its own count of real targets.
    "packed_pp2_1f1b_data2": ({}, {"pipeline": 2, "data": 2}, {"pipeline_schedule": "1f1b", "num_microbatches": 4}),
    # Parameters and optimizer state sharded over data, 2 accumulated microbatches per replica.
    "packed_zero3_data2_accum2": ({"grad_accum": 2}, {"data": 2}, {"zero_stage": 3}),
}


def test_packed_batches_pack_documents():
    """Not vacuous: several documents per row, padding, documents across the load-balanced chunks."""
    for batch in packed_batches(tiny.llama(), STEPS):
        segments = batch[:, 1, :-1]
        assert batch.shape == (16, 2, 17) and segments.max() >= 3 and (segments == 0).any()
        chunk = segments.shape[1] // 4  # context 2, balanced: 4 chunks
        left, right = segments[:, chunk - 1 : -1 : chunk], segments[:, chunk::chunk]
        assert ((left == right) & (left > 0)).any(), "a document straddles chunks"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_documents_match_single_device(name, shared_cache):
    train, mesh, parallel = PACKED_CASES[name]
    reference = single_device(shared_cache, tiny.llama(), STEPS, packed_batches)
    assert reference["losses"][-1] < reference["losses"][0] - 0.05, "the packed reference must train"
    config = tiny.with_overrides(tiny.llama(train), mesh, parallel=parallel)
    result = run(config, packed_batches(config, STEPS), math.prod(mesh.values()), reference["init_params"])
    assert_matches_reference(result, reference)


def test_gpu_defaults_match_single_device(shared_cache):
    """What `parallel.remat` and `parallel.attention_impl` "auto" resolve to on a GPU in fp32 (no
    recompute, jax's XLA attention; `jaxpar.parallel.plan`), which "auto" never picks on CPU, against
    the one-device run with CPU's choices (full recompute, jaxpar's attention kernel): the remat
    policy and the attention kernel differ between the two sides too."""
    mesh = {"data": 2, "tensor": 4}
    config = tiny.with_overrides(tiny.llama(), mesh, parallel={"sequence_parallel": True, "remat": "none", "attention_impl": "xla"})
    program = build(config, jax.devices()[:8])
    assert (program.plan.remat, program.plan.attention) == ("none", "xla")
    reference = single_device(shared_cache, tiny.llama(), STEPS)
    result = run(config, synthetic_batches(config, STEPS), 8, reference["init_params"])
    assert_matches_reference(result, reference)


def test_reference_actually_trains(shared_cache):
    # Guards the comparisons above against a degenerate (e.g. zero-learning-rate) setup.
    reference = single_device(shared_cache, tiny.llama(), STEPS)
    assert reference["losses"][-1] < reference["losses"][0] - 0.05
    assert np.all(reference["grad_norms"] > 0)


def test_the_parameter_comparison_sees_a_lost_last_update(shared_cache):
    # Positive control for the comparison of parameters after the last step, which no loss sees:
    # one data shard of one leaf (a quarter of mlp.down's embed columns) missing its last update.
    reference = single_device(shared_cache, tiny.llama(), STEPS)
    before_last = single_device(shared_cache, tiny.llama(), STEPS - 1)["final_params"]
    lost = copy.deepcopy(reference)
    down = lost["final_params"]["layers"]["mlp"]["down"]
    down[..., -16:] = before_last["layers"]["mlp"]["down"][..., -16:]
    with pytest.raises(AssertionError, match="parameters after the last step differ"):
        assert_matches_reference(lost, reference)


BF16_STEPS = 5
# bf16 rounds every activation to 8 mantissa bits; different layouts round at different points
# (partial sums per device, then the reduction), so runs agree only to bf16 precision. Measured
# worst relative difference from the one-device bf16 run over these 5 steps: losses 1.5e-3 and
# 1.1e-3, gradient norms 9.2e-3 and 1.0e-2 (bf16 vs fp32 on one device: losses 1.2e-3 apart).
BF16_CASES = {
    "data2_tensor4_sp": ({"data": 2, "tensor": 4}, {"sequence_parallel": True}),
    "data4_tensor2_zero3": ({"data": 4, "tensor": 2}, {"zero_stage": 3}),
    # 16-bit psums over `pipeline` beside a partitioned `tensor` aborted XLA:CPU's compiler before
    # `jaxpar.manual.psum_wide` (found by the 70B sweep).
    "pipeline2_tensor4_sp_spread": ({"pipeline": 2, "tensor": 4, "data": 1}, {"sequence_parallel": True, "pipeline_vocab": "spread"}),
    # Per-rank accumulation under context parallelism, against one device accumulating the same
    # 2 microbatches (measured: losses 1.0e-3, gradient norms 8.7e-3).
    "data2_context2_tensor2_accum2": ({"data": 2, "context": 2, "tensor": 2}, {}, {"grad_accum": 2}),
}
BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL = 5e-3, 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bfloat16_matches_single_device_bfloat16(name, shared_cache):
    mesh, parallel, *train = BF16_CASES[name]
    config = tiny.llama({"compute_dtype": "bfloat16", "steps": BF16_STEPS, **(train[0] if train else {})})
    reference = single_device(shared_cache, config, BF16_STEPS)
    result = run(tiny.with_overrides(config, mesh, parallel=parallel), synthetic_batches(config, BF16_STEPS), 8, reference["init_params"])
    assert reference["losses"][-1] < reference["losses"][0] - 0.05, "the bf16 run must train"
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=BF16_LOSS_RTOL)
    np.testing.assert_allclose(result["grad_norms"], reference["grad_norms"], rtol=BF16_GRAD_NORM_RTOL)
    # Not vacuous: bf16 really differs from fp32 by more than the fp32 tolerance.
    fp32 = single_device(shared_cache, tiny.llama({"steps": BF16_STEPS}), BF16_STEPS)
    assert np.max(np.abs(fp32["losses"] - reference["losses"]) / fp32["losses"]) > 1e-4


def lowered_dots(config, num_devices: int) -> list[tuple[str, str]]:
    """The operand types of every dot in the train step as jaxpar hands it to XLA."""
    program = build(config, jax.devices()[:num_devices])
    batch = jax.ShapeDtypeStruct((config.train.global_batch_size, config.train.seq_len + 1), np.int32, sharding=program.batch_sharding)
    text = program.step.lower(jax.eval_shape(program.init), batch).as_text()
    return re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)


def is_bf16(dot) -> bool:
    return all(t.endswith("xbf16>") for t in dot)


def sixteen_bit_problems(dots, vocab: int) -> list:
    """Dots that are not bf16 x bf16, other than the LM head's gradient (its cotangent, over the
    vocab, is the fp32 loss's)."""
    return [d for d in dots if not is_bf16(d) and str(vocab) not in re.findall(r"(\d+)x", d[0])]


def test_bfloat16_step_multiplies_in_bfloat16():
    """The bf16 equivalence above cannot tell bf16 from fp32 by its numbers (tolerance 5e-3, the
    bf16-fp32 loss gap 1.2e-3), so the step it runs must multiply in 16 bits: every dot takes bf16
    operands except the two of the LM head's gradient. Read from the lowered step, because XLA:CPU
    upcasts bf16 dots to f32 when it compiles (measured: all 38 compiled dots f32, fed by converts
    from bf16; 37 of the 39 lowered ones bf16). Positive control: the fp32 step fails the check."""
    mesh, parallel = BF16_CASES["data2_tensor4_sp"]
    config = tiny.with_overrides(tiny.llama({"compute_dtype": "bfloat16"}), mesh, parallel=parallel)
    vocab = 256  # 250 padded
    dots = lowered_dots(config, 8)
    assert sum(map(is_bf16, dots)) >= 30 and len(dots) - sum(map(is_bf16, dots)) <= 2, dots
    assert sixteen_bit_problems(dots, vocab) == []
    fp32 = lowered_dots(tiny.with_overrides(tiny.llama(), mesh, parallel=parallel), 8)
    assert len(sixteen_bit_problems(fp32, vocab)) >= 30
