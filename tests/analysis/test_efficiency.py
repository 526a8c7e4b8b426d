"""The achieved-rate model (`jaxpar.analysis.cost.efficiency`): its monotonic properties and its bookkeeping.

- A GEMM's efficiency never falls when any of its dims grows, never exceeds the hardware's large-GEMM
  fraction, approaches it for large shapes, and is far below it for a skinny one (one row: bound by
  reading the weights) or a tiny one (the per-kernel time).
- fp32 (TF32 on NVIDIA) is slower than bf16 for the same shape; attention's efficiency rises with the
  sequence up to the kernel's figure.
- A mixture of experts' expert matmuls get more efficient with more rows per microbatch.
- The step time adds compute, bubble and the communication that is not hidden: exactly
  compute + bubble + comm - min(overlapped, compute); ZeRO-3's per-layer gathers are overlapped,
  ZeRO-1's once-per-step traffic is not; the flat efficiency keeps the old peak model.
"""

from __future__ import annotations

import itertools

import pytest

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.cost.efficiency import attention_efficiency, matmul_efficiency
from jaxpar.analysis.cost.layout import Layout
from tests.support import tiny

SIZES = (1, 16, 128, 1024, 4096, 16384)


@pytest.mark.parametrize("profile", ["a100-80g", "h100-80g"])
def test_matmul_efficiency_is_monotone_and_bounded(profile):
    h = hw.get(profile)
    for m, n, k in itertools.product(SIZES, repeat=3):
        e = matmul_efficiency(m, n, k, 2, h, "bfloat16")
        assert 0 < e <= h.matmul_efficiency
        for grown in ((4 * m, n, k), (m, 4 * n, k), (m, n, 4 * k)):
            assert matmul_efficiency(*grown, 2, h, "bfloat16") >= e
    assert matmul_efficiency(16384, 16384, 16384, 2, h, "bfloat16") > 0.99 * h.matmul_efficiency
    # One row reads the whole weight per 2 FLOPs per element: memory bound.
    assert matmul_efficiency(1, 8192, 8192, 2, h, "bfloat16") < 0.02
    # A tiny GEMM is all kernel time.
    assert matmul_efficiency(64, 64, 64, 2, h, "bfloat16") < 0.01


def test_fp32_is_slower_than_bf16_for_the_same_matmul():
    h = hw.get("a100-80g")
    for m, n, k in [(1, 4096, 4096), (512, 4096, 4096), (8192, 8192, 8192)]:
        flops = 2 * m * n * k
        bf16 = flops / (h.peak("bfloat16") * matmul_efficiency(m, n, k, 2, h, "bfloat16"))
        fp32 = flops / (h.peak("float32") * matmul_efficiency(m, n, k, 4, h, "float32"))
        assert fp32 > bf16


def _gpu_layout(seq: int, **train):
    config = tiny.with_overrides(
        tiny.llama({"seq_len": seq, "global_batch_size": 8, "compute_dtype": "bfloat16", **train},
                   max_position_embeddings=seq), {"data": 8},
    )
    return Layout.from_config(config, 8, target="gpu")


def test_attention_efficiency_rises_with_the_sequence_to_the_kernels_figure():
    h = hw.get("h100-80g")
    values = [attention_efficiency(_gpu_layout(seq), h) for seq in (64, 256, 1024, 4096, 16384)]
    assert _gpu_layout(64).flash_attention  # the GPU plan's kernel for 16-bit compute: cuDNN
    assert values == sorted(values) and values[-1] <= h.attention_efficiency and values[-1] > 0.99 * h.attention_efficiency


def test_expert_matmuls_run_faster_with_more_rows_per_microbatch():
    h = hw.get("h100-80g")
    per_token = []
    for accum in (8, 1):  # 1 row per microbatch, then all 8 at once
        config = tiny.with_overrides(
            tiny.mixtral({"global_batch_size": 64, "seq_len": 64, "grad_accum": accum, "compute_dtype": "bfloat16"}),
            {"data": 8},
        )
        est = estimate(config, h, num_devices=8)
        per_token.append(est.time.compute_by_part["experts"])
    assert per_token[1] < per_token[0]


def _zero(stage: int, **model):
    config = tiny.with_overrides(
        tiny.llama({"global_batch_size": 64, "seq_len": 512, "compute_dtype": "bfloat16"}, max_position_embeddings=512,
                   hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                   num_hidden_layers=8, **model),
        {"data": 8}, parallel={"zero_stage": stage, "remat": "full"},
    )
    return estimate(config, "a100-80g", num_devices=8)


def test_step_time_hides_only_the_overlapped_collectives():
    zero3, zero1 = _zero(3), _zero(1)
    for est in (zero3, zero1):
        t = est.time
        assert t.seconds == pytest.approx(t.compute + t.bubble + t.comm - min(t.overlappable, t.compute))
    assert zero3.time.overlappable > 0.5 * zero3.time.comm  # its per-layer gathers and reduce-scatters
    assert zero1.time.overlappable == 0 and zero1.time.seconds == pytest.approx(zero1.time.compute + zero1.time.comm)
    flat = estimate(_zero(3).layout.config, "a100-80g", num_devices=8, efficiency=1.0)
    assert flat.time.compute == pytest.approx(flat.flops_per_device / hw.A100_80G.peak("bfloat16"))
    assert flat.time.seconds == pytest.approx(flat.time.compute + flat.time.comm)  # nothing hidden
    assert zero3.time.compute > flat.time.compute  # achieved rates are below peak
