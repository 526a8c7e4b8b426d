"""Accelerator profiles as data: peak FLOP/s per dtype, HBM size and bandwidth, link bandwidths.

Every bandwidth here is **unidirectional, per device**: the bytes one device can send per second
while it also receives as much (the "bidirectional" figures of datasheets are twice these).
That matches the cost model's convention (`jaxpar.analysis.cost.comm.wire_bytes` counts the bytes one
device sends). Peak FLOP/s are dense (no 2:4 sparsity). For GPUs, `float32` means fp32 matmuls
as XLA runs them by default on Ampere and later: TF32 tensor cores.

Sources (vendor datasheets / docs, figures as published):
- A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TFLOPS, TF32 156,
  FP32 (non-tensor) 19.5; 80GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s (bidirectional, 12 links).
  DGX A100 user guide: 8 GPUs per node, one 200 Gb/s HDR InfiniBand port per GPU.
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 1,979 TFLOPS *with sparsity*
  (989.5 dense), FP8 3,958 with sparsity (1,979 dense), TF32 989 with sparsity (494.5 dense),
  FP32 67; 80GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s (bidirectional, 18 links). DGX H100: 8 GPUs,
  one 400 Gb/s ConnectX-7 per GPU.
- H200 SXM 141GB: NVIDIA H200 datasheet: compute as H100 SXM (BF16 1,979 sparse / 989.5 dense,
  FP8 3,958 sparse / 1,979 dense, TF32 989 sparse); 141GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
  DGX H200: 8 GPUs, 400 Gb/s per GPU.
- TPU v5p: Google Cloud TPU v5p documentation (system architecture): 459 TFLOPS bf16 per chip,
  95 GiB HBM2e at 2,765 GB/s, 4,800 Gbps inter-chip interconnect (ICI) per chip, 3D torus, up to
  8,960 chips per pod. No fp32 peak is published (the MXU multiplies bf16), so `float32` is absent.
  Assumed, not published: a collective over one torus axis gets half the chip's ICI figure per
  direction (300 GB/s); the ICI domain (one pod) is the "node"; DCN per chip 6.25 GB/s (a 200 Gb/s
  host NIC shared by 4 chips) for anything crossing slices.

Achieved rates (`jaxpar.analysis.cost.efficiency`): the attention kernel's fraction of peak is taken
from kernel benchmarks, not fitted: FlashAttention-2 (Dao 2023, arXiv 2307.08691) runs forward +
backward at 50-73% of an A100's peak (0.55: the backward, two thirds of the work, sits low); on H100
a flash forward (head dim 128, bf16) measured 287-304 TFLOP/s with FlashAttention-2 and 397-429 with
a Hopper (CUTLASS) kernel from 1k to 16k tokens (pytorch/benchmark PR #2296), 0.30-0.43 of 989
(0.35 for forward + backward on cuDNN's kernel). TPU v5p: nominal 0.8 / 0.5, not validated. The
fixed time per kernel (launch and tail) is 4 us everywhere.

1 GB = 1e9 bytes for bandwidths (vendors' unit). HBM capacities: NVIDIA's "80GB" parts report
81920 MiB (A100) / 81559 MiB (H100) in nvidia-smi, so their GB figure is taken as GiB, and so is
H200's 141 and TPU v5p's 95 GiB.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2**30
TFLOPS = 1e12
FLOAT8 = "float8"  # the peak of FP8 GEMMs (e4m3 / e5m2 operands): `train.fp8`'s matmuls run at it

# The fraction of the bf16 peak a large GEMM reaches end to end in a training step, one constant per
# GPU generation, fitted on one published run each (`jaxpar.analysis.reports.published.FITTED`; refit with
# `python scripts/experiments.py --sections=published --fit`): everything else the model does not
# price (element-wise kernels, clocks under load, launch gaps) is folded into it.
A100_MATMUL_EFFICIENCY = 0.536
H100_MATMUL_EFFICIENCY = 0.497
# An FP8 GEMM's fraction of the FP8 peak over a bf16 GEMM's of the bf16 peak (`matmul_efficiency`), with
# the quantization passes and amax reductions folded in (nothing else prices them): fitted on torchtitan's
# Llama 3.1 8B FP8 run on 8 H100s (`jaxpar.analysis.reports.published_fp8.FITTED`).
H100_FP8_EFFICIENCY = 0.699


class HardwareError(ValueError):
    """An unknown profile or a dtype the profile has no peak for."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict  # compute dtype ("bfloat16", "float16", "float32"; "float8": FP8 GEMMs) -> dense FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s, unidirectional, per device (NVLink / ICI)
    inter_node_bandwidth: float  # bytes/s, unidirectional, per device (InfiniBand / DCN)
    devices_per_node: int  # devices that share the intra-node fabric
    intra_node_link: str = "NVLink"  # names for the reports
    inter_node_link: str = "InfiniBand"
    kind: str = "gpu"  # the XLA lowering the cost model prices for it (`jaxpar.analysis.cost.layout.TARGETS`)
    # Achieved rates (`jaxpar.analysis.cost.efficiency`): the fraction of peak a large GEMM reaches, the
    # fraction the fused attention kernel reaches at long sequences, and a fixed time per kernel.
    matmul_efficiency: float = 0.8
    fp8_efficiency: float = 1.0  # FP8 GEMMs reach matmul_efficiency x this of the FP8 peak
    attention_efficiency: float = 0.5
    kernel_seconds: float = 4e-6
    # Host memory <-> device per device, one direction (activation offload, parallel.remat=offload):
    # PCIe 4.0 x16 (A100) and 5.0 x16 (H100, H200) at about 80% of their 32 and 64 GB/s.
    host_bandwidth: float = 25 * GB

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise HardwareError(f"{self.name} has no published {dtype} peak; set train.compute_dtype to one of {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]


A100_80G = Hardware(
    name="a100-80g",
    peak_flops={"bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS, "float32": 156 * TFLOPS},
    hbm_bytes=80 * GIB,  # nvidia-smi reports 81920 MiB
    hbm_bandwidth=2039 * GB,
    intra_node_bandwidth=300 * GB,  # NVLink 3: 600 GB/s bidirectional
    inter_node_bandwidth=25 * GB,  # 200 Gb/s HDR InfiniBand per GPU
    devices_per_node=8,
    matmul_efficiency=A100_MATMUL_EFFICIENCY,
    attention_efficiency=0.55,  # FlashAttention-2 fwd + bwd: 50-73% of peak on A100 (Dao 2023)
)

H100_80G = Hardware(
    name="h100-80g",
    peak_flops={"bfloat16": 989.5 * TFLOPS, "float16": 989.5 * TFLOPS, "float32": 494.5 * TFLOPS, FLOAT8: 1979 * TFLOPS},
    hbm_bytes=80 * GIB,  # nvidia-smi reports 81559 MiB usable; 80 GiB as sold
    hbm_bandwidth=3350 * GB,
    intra_node_bandwidth=450 * GB,  # NVLink 4: 900 GB/s bidirectional
    inter_node_bandwidth=50 * GB,  # 400 Gb/s ConnectX-7 per GPU
    devices_per_node=8,
    host_bandwidth=50 * GB,
    matmul_efficiency=H100_MATMUL_EFFICIENCY,
    fp8_efficiency=H100_FP8_EFFICIENCY,
    attention_efficiency=0.35,  # fused flash attention on H100, bf16, head dim 128: see module doc
)

H200 = Hardware(
    name="h200",
    peak_flops={"bfloat16": 989.5 * TFLOPS, "float16": 989.5 * TFLOPS, "float32": 494.5 * TFLOPS, FLOAT8: 1979 * TFLOPS},
    hbm_bytes=141 * GIB,
    hbm_bandwidth=4800 * GB,
    intra_node_bandwidth=450 * GB,
    inter_node_bandwidth=50 * GB,
    devices_per_node=8,
    host_bandwidth=50 * GB,
    matmul_efficiency=H100_MATMUL_EFFICIENCY,
    fp8_efficiency=H100_FP8_EFFICIENCY,
    attention_efficiency=0.35,  # fused flash attention on H100, bf16, head dim 128: see module doc
)

TPU_V5P = Hardware(
    name="tpu-v5p",
    peak_flops={"bfloat16": 459 * TFLOPS},
    hbm_bytes=95 * GIB,
    hbm_bandwidth=2765 * GB,
    intra_node_bandwidth=300 * GB,  # assumed: half of 4,800 Gbps ICI per direction on one axis
    inter_node_bandwidth=6.25 * GB,  # assumed DCN share per chip
    devices_per_node=8960,  # one pod is one ICI domain
    intra_node_link="ICI",
    inter_node_link="DCN",
    kind="tpu",
)

PROFILES = {hw.name: hw for hw in (A100_80G, H100_80G, H200, TPU_V5P)}


def get(name: str) -> Hardware:
    if name not in PROFILES:
        raise HardwareError(f"unknown hardware {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]


def crosses_nodes(hardware: Hardware, mesh: dict, axes) -> bool:
    """Whether a collective over `axes` of `mesh` leaves one node (see `link_bandwidth`)."""
    names = list(mesh)
    axes = [a for a in axes if mesh[a] > 1]
    if not axes:
        return False
    block = 1
    for name in names[min(names.index(a) for a in axes):]:
        block *= mesh[name]
    return block > hardware.devices_per_node


def link_name(hardware: Hardware, mesh: dict, axes) -> str:
    return hardware.inter_node_link if crosses_nodes(hardware, mesh, axes) else hardware.intra_node_link


def link_bandwidth(hardware: Hardware, mesh: dict, axes) -> float:
    """Bandwidth per device of a collective over `axes` of `mesh` (axis name -> size, in mesh
    order, last axis fastest over the device list, as `jaxpar.mesh` lays devices out).

    A group over `axes` spans the device ids of its outermost axis times everything inside it, so
    it stays within one node when that block is at most `devices_per_node` devices (nodes are
    consecutive device ids). Otherwise the ring crosses nodes and runs at the inter-node rate
    (no hierarchical algorithm is assumed)."""
    if not any(mesh[a] > 1 for a in axes):
        return float("inf")
    return hardware.inter_node_bandwidth if crosses_nodes(hardware, mesh, axes) else hardware.intra_node_bandwidth
