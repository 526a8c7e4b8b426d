"""Achieved, not peak: how fast a device runs the step's matmuls, its attention, and which collectives hide.

The cost model (`jaxpar.analysis.cost.cost_model`) counts matmul FLOPs by part and bytes per collective;
this module turns them into seconds on a hardware profile (`jaxpar.analysis.cost.hardware`) with three
effects every GPU user sees, each a line or two of arithmetic:

1. Matmul efficiency by shape and dtype. One GEMM [m, k] x [k, n] of b-byte operands takes
       t = max(2mnk / (eta * peak), b (mk + kn + mn) / HBM bandwidth) + t_kernel,
   eta the fraction of peak a large GEMM reaches (`Hardware.matmul_efficiency`; an FP8 GEMM's times
   `Hardware.fp8_efficiency`, of the FP8 peak), the roofline
   term for skinny shapes (few rows: operands stream in faster than they are used), and a fixed
   time per kernel (launch and tail, `Hardware.kernel_seconds`) that dominates small ones. The
   backward's two GEMMs per forward one (dX = dY W^T, dW = X^T dY) move the same three operands
   and run at its efficiency. m is the rows one device multiplies at once: a microbatch's tokens
   (a routed expert: its share of them, balanced), n and k the layer's dims as the plan shards
   them; b the compute dtype's bytes, at that dtype's peak (fp32 on NVIDIA GPUs: TF32).
2. Attention at its kernel's efficiency. cuDNN's fused kernel (the plan's attention "cudnn") runs
   QK^T and PV at `Hardware.attention_efficiency` of peak for long sequences and S / (S + 128) of
   that at S keys (flat from 1k tokens up: a fused kernel's tile work grows with S); the XLA paths,
   which materialise [S, S] scores, and context parallelism's blockwise kernels run them as batched
   GEMMs of [S_q, head_dim] x [head_dim, S_kv] (blocks of `parallel.context_block_size`) by rule 1,
   one kernel per block pair for all of a microbatch's rows and the device's KV heads.
3. Communication XLA overlaps with compute. XLA's GPU compiler issues collectives asynchronously
   and its latency-hiding scheduler moves them off the critical path when no op waits for them
   (MaxText's GPU recipes turn it on with --xla_gpu_enable_latency_hiding_scheduler and the
   pipelined all-gather / reduce-scatter flags). Overlapped (`Planned.overlap`): ZeRO-3's per-layer
   weight all-gathers (the next layer's runs during this layer's compute) and per-layer gradient
   reductions inside the backward scan, and the context ring's K/V permutes (the next block's
   during this block's attention). Exposed: everything whose result the very next op consumes —
   tensor / sequence parallelism's reductions and gathers, the expert all-to-alls, the context
   all-gather and all-to-all exchanges, the pipeline's permutes (the engine's lockstep time steps) —
   and what runs once per step after the last matmul: the gradient reduction after accumulation
   and ZeRO-1's gather of the updated parameters.
       step = compute + bubble + exposed + max(0, overlapped - compute)

Not modelled: element-wise and normalisation kernels (memory-bound, a few % of a large model's
step), the optimizer update's HBM traffic, kernel fusion, host overheads, stragglers, and
collectives' latency (only bandwidth is priced). `step_time(..., efficiency=x)` keeps the flat
model (x of peak for every matmul, nothing overlapped) as a bound.
"""

from __future__ import annotations

import dataclasses

from jaxpar import fp8
from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.cost.planned import Planned
from jaxpar.parallel.context.blockwise import chunk_size

# Attention on a fused kernel reaches `S / (S + ATTENTION_HALF_SEQ)` of its long-sequence rate:
# a flash-attention forward on H100 (head dim 128, bf16) measured 397, 401, 422, 427, 429 TFLOP/s
# at 1k, 2k, 4k, 8k, 16k tokens (pytorch/benchmark PR #2296, CUTLASS kernel): 0.93 of the 16k rate
# at 1k, which 128 reproduces (0.89 at 1k, 0.98 at 8k).
ATTENTION_HALF_SEQ = 128
# Context parallelism's blockwise kernels write both dots' results in fp32 (`preferred_element_type`).
BLOCK_RESULT_BYTES = 4


def matmul_efficiency(m: float, n: float, k: float, dtype_bytes: int, hardware: hw.Hardware, dtype: str,
                      batch: float = 1, out_bytes: int | None = None) -> float:
    """Fraction of `hardware`'s `dtype` peak one [m, k] x [k, n] GEMM reaches (rule 1); `batch` of
    them in one batched kernel share its fixed time; `out_bytes`: the result's element size when
    not the operands' (an fp32 result)."""
    if min(m, n, k) <= 0:
        return 1.0
    peak = hardware.peak(dtype)
    flops = 2.0 * m * n * k * batch
    eta = hardware.matmul_efficiency * (hardware.fp8_efficiency if dtype == hw.FLOAT8 else 1.0)
    compute = flops / (eta * peak)
    out_bytes = dtype_bytes if out_bytes is None else out_bytes
    memory = batch * (dtype_bytes * (m * k + k * n) + out_bytes * m * n) / hardware.hbm_bandwidth
    return flops / (peak * (max(compute, memory) + hardware.kernel_seconds))


def context_block_shape(layout: Layout) -> tuple[float, int, float]:
    """(m, n, batch) of the QK^T dot (n = the key chunk, contraction head_dim) that context
    parallelism's blockwise kernels (`jaxpar.parallel.context.blockwise`) run per query chunk x key
    chunk: one dot_general batched over the microbatch's rows and the device's KV heads, each
    query-head group's G heads times the query chunk as its rows ("bqhgd,bkhd->bhgqk"). PV is the
    same shape transposed. all_to_all: whole sequences, 1/c of the heads; all_gather: key chunks of
    the gathered sequence; ring: of each rank's block."""
    block, local, c = layout.plan.context.block, layout.seq // layout.c, layout.c
    rows = max(layout.rows // layout.microbatches, 1)
    q_heads = layout.heads / layout.t
    kv_heads = layout.local_kv_heads
    if layout.context_impl == "all_to_all":
        size = chunk_size(layout.seq, block)
        q_heads, kv_heads = q_heads / c, max(kv_heads / c, 1)
        return size * q_heads / kv_heads, size, rows * kv_heads
    keys = chunk_size(layout.seq if layout.context_impl == "all_gather" else local, block)
    return chunk_size(local, block) * q_heads / kv_heads, keys, rows * kv_heads


def attention_efficiency(layout: Layout, hardware: hw.Hardware) -> float:
    """Fraction of peak the attention kernel's QK^T and PV reach (rule 2)."""
    dtype = layout.compute_dtype_name
    if layout.flash_attention:
        return hardware.attention_efficiency * layout.seq / (layout.seq + ATTENTION_HALF_SEQ)
    if layout.c > 1:
        # Batched: one kernel time per block pair, not per head, as the traced kernel's dots show
        # (per head it was 32 launches where XLA runs one: docs/planner.md has the before and after).
        # QK^T writes its [m, n] scores in fp32 and PV reads the probabilities cast back to the
        # input dtype: the two dots' mean rate (equal FLOPs each).
        m, n, batch = context_block_shape(layout)
        d, b = layout.head_dim, layout.activation_bytes
        qk = matmul_efficiency(m, n, d, b, hardware, dtype, batch, out_bytes=BLOCK_RESULT_BYTES)
        pv = matmul_efficiency(m, d, n, b, hardware, dtype, batch, out_bytes=BLOCK_RESULT_BYTES)
        return 2 / (1 / qk + 1 / pv)
    return matmul_efficiency(layout.seq, layout.seq, layout.head_dim, layout.activation_bytes, hardware, dtype)


def part_shapes(layout: Layout) -> dict:
    """(m, n, k) of one device's GEMM for each matmul part of `cost_model.forward_flops_per_token`."""
    m = layout.tokens / layout.microbatches  # one microbatch's tokens on this device
    t, d = layout.t, layout.hidden
    tk = t if layout.kv_sharded else 1
    shapes = {
        "qo": (m, layout.heads * layout.head_dim / t, d),
        "kv": (m, layout.kv_heads * layout.head_dim / tk, d),
        "latent": (m, sum(layout.facts.latent_widths) or 1, d),
        "mlp": (m, layout.ffn / t, d),
        "head": (m, layout.vocab / layout.vocab_shards, d),
        "optimizer": (d, d, layout.ffn),  # Muon's Newton-Schulz: products of whole weight matrices
    }
    if layout.is_moe:
        moe = layout.facts.moe
        # Balanced routing: an expert parallel group's rows spread evenly over its E experts.
        rows = m * moe.routed_rows(layout.seq) * layout.e / layout.experts
        shapes["router"] = (m, layout.experts, d)
        shapes["experts"] = (rows, layout.expert_ffn / t, d)
    return shapes


@dataclasses.dataclass(frozen=True)
class Compute:
    seconds: float
    by_part: dict  # part -> seconds
    efficiency: dict  # part -> fraction of peak


def compute_seconds(layout: Layout, flops_by_part: dict, hardware: hw.Hardware) -> Compute:
    """Seconds of the step's matmuls, part by part at each part's efficiency (rules 1 and 2).
    The parts `train.fp8` runs in FP8 (`jaxpar.fp8.cost_parts`) at the FP8 peak, reading 1-byte
    operands, where the hardware has one (else at the compute dtype's: no FP8 GEMMs there)."""
    dtype = layout.compute_dtype_name
    shapes = part_shapes(layout)
    in_fp8 = fp8.cost_parts(layout.config.train) if hw.FLOAT8 in hardware.peak_flops else frozenset()
    by_part, eff = {}, {}
    for part, flops in flops_by_part.items():
        if flops <= 0:
            continue
        part_dtype, part_bytes = (hw.FLOAT8, 1) if part in in_fp8 else (dtype, layout.compute_bytes)
        if part == "attention":
            eff[part] = attention_efficiency(layout, hardware)
        else:
            m, n, k = shapes[part]
            eff[part] = matmul_efficiency(m, n, k, part_bytes, hardware, part_dtype)
        by_part[part] = flops / (hardware.peak(part_dtype) * eff[part])
    return Compute(sum(by_part.values()), by_part, eff)


def overlapped(p: Planned) -> bool:
    """Whether XLA can run this collective behind compute (rule 3)."""
    return p.overlap
