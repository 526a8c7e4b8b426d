"""Published FP8 GPU training runs, and the cost model's prediction for each with `train.fp8` set.

The FP8 counterpart of `jaxpar.analysis.reports.published` (same `PublishedRun` records, the same raw
error and ±25% bound): Llama 3 / 3.1 training with FP8 linear layers on H100s from two systems' own
benchmark documents, torchtitan's end-of-2024 H100 benchmark and Megatron-Bridge's performance summary.
Both publish tokens/s per GPU, so no unit is converted; Megatron-Bridge also gives model TFLOP/s per GPU,
which tests/analysis/test_published_fp8.py checks against its causal FLOP count (`causal_flops_per_token`).
Recipes: torchtitan's float8 (torchao's dynamic tensorwise scaling) and Megatron-Bridge's "FP8-CS" (per-tensor
current scaling) are both `train.fp8 = "tensorwise"`.

Hardware. Megatron-Bridge's runs are on DGX H100 (`h100-80g`). torchtitan's are on Grand Teton hosts whose
H100s have 96GB HBM2e at 2.4 TB/s and run at a 500 W power limit, with a peak "between SXM and NVL" the
document does not know; `GRAND_TETON` is the H100 profile with that memory and its own bf16 matmul
efficiency, fitted on the bf16 run the same table publishes beside the FP8 one.

Constants, fitted on two named runs (`FITTED`), every other run held out:
- `GRAND_TETON.matmul_efficiency`: torchtitan's Llama 3.1 8B bf16 run (FSDP 8, torch.compile);
- `hardware.H100_FP8_EFFICIENCY` (an FP8 GEMM's fraction of the FP8 peak over bf16's of the bf16 peak,
  quantization passes folded in; the planner's H100 and H200 profiles carry it): torchtitan's FP8 run
  of the same model, batch and layout.
The DGX H100 bf16 efficiency stays the one `published` fitted on MaxText's Llama 2 7B.
"""

from __future__ import annotations

import dataclasses

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import Estimate, estimate
from jaxpar.analysis.reports.markdown import table as _table
from jaxpar.analysis.reports.published import MEGATRON_VOCAB, TARGET_ERROR, PublishedRun, llama3_8b, llama3_70b
from jaxpar.axes import CONTEXT, DATA, PIPELINE, TENSOR
from jaxpar.models import llama
from jaxpar.models.families import facts as model_facts

TORCHTITAN_H100 = (
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan@31a17bf: Grand Teton, 8 H100 96GB HBM2e "
    "per host at 500 W, 400 Gb/s RDMA per GPU; torch, torchao, torchtitan of 2024-12-23/26); sequence length 8192 from "
    "the presets it runs, train_configs/llama3_8b.toml and llama3_70b.toml (pytorch/torchtitan@0011fb9, @08e5379)"
)
MEGATRON_BRIDGE_H100 = (
    "Megatron-Bridge docs/performance-summary.md (NVIDIA-NeMo/Megatron-Bridge@00b7660), \"25.11 NeMo Container\", "
    "\"Pre-Training Performance\", \"System: DGX-H100\""
)

GRAND_TETON_MATMUL_EFFICIENCY = 0.366
GRAND_TETON = dataclasses.replace(
    hw.H100_80G, name="h100-96g-500w", hbm_bytes=96 * hw.GIB, hbm_bandwidth=2400 * hw.GB,
    matmul_efficiency=GRAND_TETON_MATMUL_EFFICIENCY,
)
PROFILES = {GRAND_TETON.name: GRAND_TETON}


def llama31_405b():
    return llama.model_config(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False,
    )


@dataclasses.dataclass(frozen=True)
class FP8Run(PublishedRun):
    fp8: str = "tensorwise"  # the `train.fp8` recipe matching the publication ("none": its bf16 baseline)
    published_tflops: float = 0.0  # model TFLOP/s per GPU as published beside the tokens/s (causal count)

    def config(self):
        c = super().config()
        c.train.fp8 = self.fp8
        return c

    def profile(self) -> hw.Hardware:
        return PROFILES.get(self.hardware) or hw.get(self.hardware)


FSDP_SELECTIVE = {"zero_stage": 3, "remat": "save_dots"}
FSDP_FULL = {"zero_stage": 3, "remat": "full"}
RUNS = (
    FP8Run(
        "Llama 3.1 8B bf16, FSDP 8", "torchtitan", TORCHTITAN_H100, GRAND_TETON.name, llama3_8b, 8192, 16,
        "FSDP 8, local batch 2, selective AC, torch.compile", {DATA: 8}, FSDP_SELECTIVE, tokens_per_gpu=6667, fp8="none",
        note="Table 1's bf16 row, the baseline of the FP8 one",
    ),
    FP8Run(
        "Llama 3.1 8B, FSDP 8", "torchtitan", TORCHTITAN_H100, GRAND_TETON.name, llama3_8b, 8192, 16,
        "FSDP 8, local batch 2, selective AC, torch.compile + Float8", {DATA: 8}, FSDP_SELECTIVE, tokens_per_gpu=8532,
    ),
    FP8Run(
        "Llama 3.1 8B, FSDP 128", "torchtitan", TORCHTITAN_H100, GRAND_TETON.name, llama3_8b, 8192, 256,
        "FSDP 128, local batch 2, selective AC, torch.compile + Float8", {DATA: 128}, FSDP_SELECTIVE, tokens_per_gpu=8380,
    ),
    FP8Run(
        "Llama 3.1 8B 32k, FSDP 8", "torchtitan", TORCHTITAN_H100, GRAND_TETON.name, llama3_8b, 32768, 8,
        "FSDP 8, CP 1, local batch 1, full AC, torch.compile + Float8", {DATA: 8}, FSDP_FULL, tokens_per_gpu=3890,
    ),
    FP8Run(
        "Llama 3.1 8B 64k, FSDP 4 CP 2", "torchtitan", TORCHTITAN_H100, GRAND_TETON.name, llama3_8b, 65536, 4,
        "FSDP 4, CP 2, local batch 1, full AC, torch.compile + Float8", {DATA: 4, CONTEXT: 2}, FSDP_FULL,
        tokens_per_gpu=2540,
    ),
    FP8Run(
        "Llama 3.1 70B, FSDP 32 TP 8", "torchtitan", TORCHTITAN_H100, GRAND_TETON.name, llama3_70b, 8192, 512,
        "256 GPUs, FSDP 32, TP 8, local batch 16, full AC, torch.compile + Float8 (AsyncTP off)", {DATA: 32, TENSOR: 8},
        {**FSDP_FULL, "sequence_parallel": True}, tokens_per_gpu=829,
    ),
    FP8Run(
        "Llama 3 8B, FSDP 8", "Megatron-Bridge", MEGATRON_BRIDGE_H100, "h100-80g", llama3_8b, 8192, 128,
        "FSDP 8, MBS 1, GA 16, FP8-CS", {DATA: 8}, {"zero_stage": 3, "remat": "none"}, grad_accum=16,
        tokens_per_gpu=14451, published_tflops=744,
        note="Megatron-Bridge's 25.11 H100 FP8-CS recipe also recomputes 5 of the 32 layers, priced without",
    ),
    FP8Run(
        "Llama 3 70B, TP 4 PP 8 VP 5", "Megatron-Bridge", MEGATRON_BRIDGE_H100, "h100-80g", llama3_70b, 8192, 128,
        "64 GPUs, TP 4, PP 8, VP 5, DP 2, MBS 1, GA 64, FP8-CS", {DATA: 2, TENSOR: 4, PIPELINE: 8},
        {"zero_stage": 1, "remat": "none", "sequence_parallel": True, "pipeline_schedule": "interleaved_1f1b",
         "virtual_stages": 5, "num_microbatches": 64,
         "pipeline_vocab": MEGATRON_VOCAB}, tokens_per_gpu=1602, published_tflops=719,
    ),
    FP8Run(
        "Llama 3.1 405B, TP 8 PP 8 CP 2 VP 8", "Megatron-Bridge", MEGATRON_BRIDGE_H100, "h100-80g", llama31_405b, 8192,
        512, "1024 GPUs, TP 8, PP 8, CP 2, VP 8, DP 8, MBS 1, GA 64, FP8-CS", {DATA: 8, CONTEXT: 2, TENSOR: 8, PIPELINE: 8},
        {"zero_stage": 1, "remat": "none", "sequence_parallel": True, "pipeline_schedule": "interleaved_1f1b",
         "virtual_stages": 8, "num_microbatches": 64,
         "pipeline_vocab": MEGATRON_VOCAB}, tokens_per_gpu=292, published_tflops=737,
    ),
)
# The constant -> the run it was fitted on.
FITTED = {"GRAND_TETON.matmul_efficiency": RUNS[0].name, "hardware.H100_FP8_EFFICIENCY": RUNS[1].name}


def run_named(name: str) -> FP8Run:
    return next(r for r in RUNS if r.name == name)


def predict(run: FP8Run, hardware: hw.Hardware | None = None) -> Estimate:
    return estimate(run.config(), hardware or run.profile(), num_devices=run.devices)


def error(run: FP8Run, hardware: hw.Hardware | None = None) -> float:
    """Predicted tokens/s per GPU over the published, less one (raw: nothing subtracted)."""
    return predict(run, hardware).tokens_per_second_per_device / run.tokens_per_gpu - 1


def _bisect(err, lo: float, hi: float) -> float:
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if err(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit(constant: str) -> float:
    """The value of `constant` (a `FITTED` key) at which its run is predicted exactly (the prediction
    grows with either constant); the other constant as it stands."""
    run = run_named(FITTED[constant])
    base = run.profile()
    field = "matmul_efficiency" if constant.endswith("matmul_efficiency") else "fp8_efficiency"
    return _bisect(lambda x: error(run, dataclasses.replace(base, **{field: x})), 0.1, 1.0)


def causal_flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token with the causal half of attention: 3 x (2 x the matmul parameters a
    token touches, LM head included) + 3 x 2 x S x heads x head_dim per layer (half of the S keys)."""
    f = model_facts(model)
    matmuls = f.layers * (f.flops_q_o + f.flops_k_v + f.flops_mlp)
    return 3 * (matmuls + f.flops_head + f.layers * f.flops_attention_per_key * seq / 2)


def is_fitted(run: FP8Run) -> bool:
    return run.name in FITTED.values()


def verdict(run: FP8Run) -> str:
    if is_fitted(run):
        return "fitted"
    return f"held out, {'within' if abs(error(run)) <= TARGET_ERROR else 'OUTSIDE'} ±{TARGET_ERROR:.0%}"


HEADER = [
    "run", "system", "hardware", "train.fp8", "seq", "global batch", "layout as published", "published tok/s/GPU",
    "jaxpar layout", "predicted tok/s/GPU", "error", "verdict",
]


def rows() -> list[list[str]]:
    out = []
    for run in RUNS:
        est = predict(run)
        predicted = est.tokens_per_second_per_device
        out.append([
            run.name, run.system, run.hardware, run.fp8, str(run.seq), str(run.global_batch), run.layout,
            f"{run.tokens_per_gpu:,.0f}", est.layout.describe(), f"{predicted:,.0f}",
            f"{100 * (predicted / run.tokens_per_gpu - 1):+.1f}%", verdict(run),
        ])
    return out


def split(est: Estimate) -> str:
    """Where the predicted step goes: the largest compute parts, exposed communication, the bubble."""
    t = est.time
    parts = sorted(t.compute_by_part.items(), key=lambda kv: -kv[1])[:3]
    exposed = sum(t.exposed_by_axes.values())
    text = ", ".join(f"{part} {sec / t.seconds:.0%}" for part, sec in parts)
    return f"{text}, exposed communication {exposed / t.seconds:.0%}, bubble {t.bubble / t.seconds:.0%} of {t.seconds:.2f} s"


# Why a held-out run misses (not measured: what the prediction's step split points at).
WHY = {
    "Llama 3.1 8B 64k, FSDP 4 CP 2": "jaxpar's context attention is its XLA blockwise kernel (`jaxpar.parallel.context."
    "blockwise`): per 512 x 512 block pair two dots batched over the 8 KV heads, whose fp32 scores go through HBM "
    "(memory-bound: 12% of peak on these H100s, rule 2 of `jaxpar.analysis.cost.efficiency`), where torchtitan runs a "
    "fused flash kernel per ring step (priced at the fused kernel's 35% instead, the model gives +16%)",
    "Llama 3 70B, TP 4 PP 8 VP 5": "the prediction prices jaxpar's pipeline engine, which re-runs each stage's forward "
    "in its backward (a quarter of a middle rank's layer compute) and waits for its tensor and pipeline exchanges in "
    "lockstep; Megatron keeps the activations (no recompute asked) and overlaps them, as the bf16 Mixtral run above",
    "Llama 3.1 405B, TP 8 PP 8 CP 2 VP 8": "jaxpar cannot run this layout as published: 126 layers do not split over 8 "
    "pipeline ranks, so jaxpar replicates the layer stack over `pipeline` (the layout does not fit an H100) and the "
    "interleaved schedule moves it into stage order every step; on top, the pipeline engine and the blockwise "
    "context attention of the two runs above",
}


def section() -> list[str]:
    """The FP8 part of docs/experiments.md's section 7 (the table is what tests/analysis/test_published_fp8.py
    recomputes)."""
    held = [run for run in RUNS if not is_fitted(run)]
    errors = {run.name: error(run) for run in RUNS}
    within = [run for run in held if abs(errors[run.name]) <= TARGET_ERROR]
    lines = [
        "### FP8 runs",
        "",
        "Published FP8 training throughput of Llama 3 / 3.1 on H100s from two systems' benchmark documents, priced",
        "with `train.fp8` set to the publication's recipe (`jaxpar.analysis.reports.published_fp8`; both publish tokens/s",
        "per GPU). Two constants are fitted, each on one named run: "
        + "; ".join(f"`{c}` = {fit_value(c):.3f} on *{n}*" for c, n in FITTED.items()) + ".",
        "torchtitan's H100s are 96GB HBM2e parts at 500 W (its own profile, `h100-96g-500w`); Megatron-Bridge's",
        "DGX H100 runs keep the bf16 constant fitted above. Every other run is held out; the error is the raw one.",
        "",
        *_table(HEADER, rows()),
        "",
        f"Held out: {len(within)} of {len(held)} within ±{TARGET_ERROR:.0%} "
        f"({', '.join(f'{run.name} {100 * errors[run.name]:+.0f}%' for run in held)}).",
        "",
    ]
    for run in held:
        if abs(errors[run.name]) > TARGET_ERROR:
            lines += [
                f"- {run.name} misses by {100 * errors[run.name]:+.0f}%, outside the bound: a known failure "
                f"(tests/analysis/test_published_fp8.py marks it a strict xfail). What may explain it, not measured: "
                f"{WHY.get(run.name, 'unexplained')} (predicted step: {split(predict(run))}).",
                "",
            ]
    lines += ["FP8 sources:", ""] + [f"- {system}: {source}" for system, source in sorted({(r.system, r.source) for r in RUNS})]
    lines += ["", "Notes: " + "; ".join(f"{r.name}: {r.note}" for r in RUNS if r.note) + ".", ""]
    return lines


def fit_value(constant: str) -> float:
    """The constant as the model holds it now."""
    if constant == "GRAND_TETON.matmul_efficiency":
        return GRAND_TETON.matmul_efficiency
    return hw.H100_FP8_EFFICIENCY
