"""Reproduce the source article's experiments with jaxpar and write docs/experiments.md.

    python scripts/experiments.py --out=docs/experiments.md [--sections=tp,...] [--sweeps=docs/sweeps/A,...]

Sections (each measured here, on emulated CPU devices, or priced by `jaxpar.analysis`):
  tp        Llama-2-7B on 8 devices, TP 1/2/4/8: compiled per-device memory and collective bytes
            (abstract inputs, nothing allocated), with the model's A100 step-time split.
  pipeline  bubble against microbatch count for every schedule (the schedule tables).
  context   context-parallel communication against sequence length, every parallel.context_impl,
            compiled and priced by the model.
  expert    a short Mixtral run on the built-in corpus with the load-balancing loss, with
            loss-free balancing's router bias, and with neither: per-expert and per-device token shares.
  plan      the 70B recommendation for 8 x A100-80G (`scripts/plan.py`'s answer).
  fidelity  the compiled sweeps in --sweeps (`scripts/sweep.py` outputs), summarised.
  published published bf16 and FP8 GPU training runs beside the model's prediction (`...reports.published`, `_fp8`;
            --fit prints the constants its FITTED runs imply, for `jaxpar.analysis.cost.hardware`).
  zero_context  ZeRO over data x context, Llama-3-70B, long sequences (`jaxpar.analysis.reports.zero_memory`).
The article: "这不是“背概念”，而是搞懂大模型训练时GPU到底在忙什么" (Chinese), sections 2, 4, 5, 6.
"""

import functools
import os
import sys
import time

from jaxpar import command
from jaxpar.analysis.reports.markdown import table as _table
from jaxpar.command import Command, Flag

ARTICLE = "这不是“背概念”，而是搞懂大模型训练时GPU到底在忙什么"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("tp", "pipeline", "context", "expert", "plan", "fidelity", "published", "zero_context")
FLAGS = (
    Flag("out", str, "docs/experiments.md", "markdown file to write"),
    Flag("sections", list, ",".join(SECTIONS), "sections to measure, in this order", choices=SECTIONS),
    Flag("fit", bool, False, "print the matmul efficiency each FITTED published run implies, and exit"),
    Flag("sweeps", list, "", "directories written by scripts/sweep.py to summarise"),
    Flag("keep_others", bool, False, "recompute only --sections; keep every other section as it stands in --out (sections are "
         "numbered in the default order)"),
    Flag("published_planner", bool, True, "section published: also the planner's best layout per run (a whole search per run: slow)"),
    Flag("expert_steps", int, 120, "training steps per Mixtral run", at_least=1),
)
GIB = 2**30


# ---- TP on Llama-2-7B --------------------------------------------------------------------------------


def config_file(name: str):
    """configs/NAME.py's config."""
    from jaxpar.command.config_file import load_config

    return load_config(os.path.join(ROOT, "configs", f"{name}.py"))


def with_mesh(config, mesh: dict, **sections):
    """A copy of `config` on the mesh (unnamed axes: 1) with `section={key: value}` overrides."""
    from jaxpar.axes import MESH_AXES

    config = config.copy_and_resolve_references()
    config.mesh.update({axis: mesh.get(axis, 1) for axis in MESH_AXES})
    for section, values in sections.items():
        config[section].update(values)
    return config


def section_tp() -> list[str]:
    from jaxpar.analysis.cost.cost_model import estimate
    from jaxpar.analysis.reports.fidelity import compare
    from jaxpar.axes import DATA, TENSOR
    rows, out = [], {}
    for zero in (0, 1):
        for t in (1, 2, 4, 8):
            config = with_mesh(config_file("llama2_7b"), {DATA: 8 // t, TENSOR: t}, parallel={"zero_stage": zero})
            fid = compare(config)
            gpu = estimate(config, "a100-80g", num_devices=8)
            by_axes = fid.compiled_bytes_by_axes()
            tp_bytes = sum(b for axes, b in by_axes.items() if TENSOR in axes)
            dp_bytes = sum(b for axes, b in by_axes.items() if DATA in axes and TENSOR not in axes)
            tm = gpu.time
            out[(zero, t)] = (fid, gpu, tp_bytes)
            rows.append([
                zero, t, 8 // t, f"{fid.compiled.memory.live_total / GIB:.1f}", f"{fid.estimate.memory.peak / GIB:.1f}",
                f"{gpu.memory.peak / GIB:.1f}", f"{gpu.memory.state / GIB:.1f}", f"{tp_bytes / 1e9:.2f}", f"{dp_bytes / 1e9:.2f}",
                f"{tm.compute:.2f} / {tm.comm_by_axes.get((TENSOR,), 0):.3f} / {tm.comm - tm.comm_by_axes.get((TENSOR,), 0):.3f}",
                f"{gpu.tokens_per_second:,.0f}", "yes" if gpu.memory.peak <= 0.9 * 80 * GIB else "no",
            ])
    _, g1, _ = out[(0, 1)]
    _, g4, b4 = out[(0, 4)]
    _, g8, b8 = out[(0, 8)]
    drop = 1 - g4.memory.peak / g1.memory.peak
    speed4 = g4.tokens_per_second / g1.tokens_per_second - 1
    speed8 = g8.tokens_per_second / g4.tokens_per_second - 1
    act = g8.layout.tokens / g8.layout.microbatches * g8.layout.hidden * 2  # one microbatch's output, bf16
    lines = [
        "## 1. Tensor parallelism on Llama-2-7B, 8 devices (article section 2.2)",
        "",
        "Llama-2-7B (6.7B parameters), global batch 16 x 4096 tokens, 2 accumulation steps, bf16 compute with fp32",
        "master parameters and AdamW, remat full; data = 8 / tensor. *compiled*: XLA:CPU's per-device bytes for the",
        "real train step on 8 emulated devices (abstract inputs; XLA:CPU keeps bf16 activations in fp32, so these",
        "exceed a GPU's); *model CPU*: the analytic model for that program; *A100*: the model for the GPU lowering;",
        "*state*: parameters + AdamW moments. Collective bytes are per device per step (wire bytes, ring algorithms),",
        "from the compiled HLO. Step time split: compute / tensor communication / other communication, on A100-80G.",
        "",
        *_table(
            ["ZeRO", "tensor", "data", "compiled GiB", "model CPU GiB", "A100 GiB", "state GiB", "tensor GB", "data GB",
             "A100 s: compute / TP / DP", "tokens/s (A100)", "fits 80G"],
            rows,
        ),
        "",
        "What the article claims, against these numbers:",
        "",
        f"- *\"TP 1 to 4 cuts memory by 40%\"*: here {100 * drop:.0f}% (A100 model, ZeRO 0). Tensor parallelism divides the",
        "  parameters, gradients and optimizer state of every matmul by t and, with remat full, most activations; what",
        "  stays is the replicated norms, the per-device batch and the loss buffers. Without ZeRO, TP 1 cannot hold",
        f"  6.7B parameters with AdamW on an 80 GB GPU at all ({g1.memory.state / GIB:.0f} GiB of state alone), so the",
        "  article's 32 GB at TP 1 implies some sharding it does not mention.",
        f"- *\"throughput +77% from TP 1 to 4, and TP 8 is slower\"*: the model predicts {100 * speed4:+.0f}% from TP 1 to 4",
        f"  and {100 * speed8:+.0f}% from 4 to 8: with the global batch fixed, TP does not add compute throughput (every",
        "  layout does the same matmuls on 8 devices); it only adds communication, so it can only lose unless it is",
        "  what makes the model fit.",
        "- *\"each TP all-reduce syncs about 1.2 GB of parameters\"*: TP all-reduces move activations, not parameters:",
        f"  one microbatch's [tokens, hidden] output per all-reduce, {act / 1e6:.0f} MB in bf16 at TP 8 here, about four per layer",
        f"  per pass. The step moves {b8 / 1e9:.1f} GB per device at TP 8 (compiled), {b4 / 1e9:.1f} GB at TP 4.",
        "",
    ]
    return lines


# ---- pipeline bubble -------------------------------------------------------------------------------


def section_pipeline() -> list[str]:
    from jaxpar.analysis.cost.layout import pipeline_shape
    from jaxpar.parallel.pipeline.schedules import schedule_kind, theoretical_bubble

    lines = [
        "## 2. Pipeline bubble against microbatch count (article section 4.2)",
        "",
        "Idle fraction of each schedule's table (`jaxpar.parallel.pipeline.schedules.bubble_fraction`: F costs 1,",
        "B 2, or B = W = 1 when the backward is split), next to the textbook formula, and the stashed stage inputs",
        "the busiest rank holds (`pipeline.slots`). These tables are what the engine executes.",
        "",
    ]
    for p in (4, 8):
        rows = []
        for m in (p, 2 * p, 4 * p, 8 * p, 16 * p):
            row = [m]
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipev", 2)):
                if schedule_kind(name).problems(p, m, v):  # dualpipev needs m >= 2p
                    row.append("-")
                    continue
                shape = pipeline_shape(name, p, m, v)
                row.append(f"{100 * shape.bubble_fraction:.1f}% ({100 * theoretical_bubble(name, p, m, v):.1f}%), {shape.act_slots:.0f}")
            rows.append(row)
        lines += [f"p = {p} ranks. Cell: table bubble (textbook), stashed stage inputs per rank (with v = 2 each is half a rank's layers).", ""]  # noqa: E501
        lines += _table(["microbatches", "GPipe", "1F1B", "interleaved 1F1B (v=2)", "ZB-H1", "ZB-V", "DualPipeV"], rows) + [""]
    one_f = pipeline_shape("1f1b", 4, 24, 1).bubble_fraction
    lines += [
        "What the article claims:",
        "",
        "- *\"in 8-card PP the ideal bubble is 0\"*: no schedule reaches 0 with finitely many microbatches; 1F1B idles",
        "  (p - 1) / (m + p - 1) of the time, GPipe the same with m stashed microbatches instead of p.",
        f"- *\"11% bubble\"* for 4 stages matches 1F1B with about 24 microbatches ({100 * one_f:.1f}% here); the remedy it",
        "  names, more microbatches or interleaving, is what the table shows; zero-bubble ZB-H1 goes further and",
        "  stashes no more than 1F1B.",
        "- *\"each card keeps one microbatch's activations\"* under 1F1B: the busiest rank keeps at least p stage",
        "  inputs in flight (more with this engine's lockstep steps: the counts above), independent of m; GPipe keeps",
        "  all m. That is why 1F1B's activation memory grows with p, not with the microbatch count.",
        "- The V schedules (rank r holds stages r and 2p - 1 - r): ZB-V's table takes 6m + p - 1 unit steps at",
        "  p <= 4 and at these (p, m) (up to p - 4 more at some other m, p = 5..8: a greedy layout), the least a lockstep table can "
        "— the papers' zero",
        "  bubble hides the last rank's p - 1 start-up steps across iterations (optimizer post-validation), which a",
        "  synchronous step cannot. DualPipeV in lockstep costs its F & B cells F + B and lands on ZB-H1's bubble",
        "  exactly, with 2p + 1 stashed chunk inputs (DeepSeek's PP + 1). Both keep at most 2p chunk inputs",
        "  (+ 1), i.e. 1F1B's p microbatches of a whole rank's layers.",
        "",
    ]
    return lines


# ---- context parallelism ---------------------------------------------------------------------------


def section_context() -> list[str]:
    lines = ["## 3. Context parallelism: communication against sequence length (article section 5.1)", ""]
    # Analytic, independent of jaxpar's implementation: the article's KV arithmetic.
    S, L, kv, hd = 131072, 32, 8, 128  # Llama-3-8B at 128k
    kv_cache = 2 * L * S * kv * hd * 2
    gathered = 2 * S * kv * hd * 2 * 3 / 4  # one layer's K and V gathered over 4 ranks, bf16
    lines += [
        "What the article claims, by arithmetic (Llama-3-8B shapes: 32 layers, 8 KV heads of 128, bf16):",
        "",
        "- *\"KV cache at 128k is 128k^2 x 2 x 2 B = 64 GB (O(seq^2))\"*: K and V grow linearly with the sequence:",
        f"  2 x layers x S x kv_heads x head_dim x 2 B = {kv_cache / 1e9:.1f} GB at 128k. The quadratic object is the",
        "  attention score matrix, which flash attention never materialises.",
        "- *\"CP=4 all-gathers about 16 MB per step\"*: all-gathering one layer's K and V over 4 ranks sends",
        f"  {gathered / 1e6:.0f} MB per device per layer, x 32 layers forward (and again backward): gigabytes, not 16 MB.",
        "",
    ]
    return lines + _context_measured()


def _context_measured() -> list[str]:
    from jaxpar.analysis.reports.fidelity import compare
    from jaxpar.axes import CONTEXT, DATA
    from jaxpar.config import base_config
    from jaxpar.models.llama import model_config

    rows = []
    for impl in ("all_gather", "ring", "all_to_all"):
        for c in (2, 4, 8):
            for seq in (2048, 8192):
                tiny = base_config()
                tiny.model = model_config(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=8, head_dim=32, max_position_embeddings=seq)
                tiny.train.update(global_batch_size=8 // c, seq_len=seq, steps=3, learning_rate=1e-2, warmup_steps=0)
                config = with_mesh(tiny, {DATA: 8 // c, CONTEXT: c}, parallel={"context_impl": impl})
                fidelity = compare(config)
                compiled = fidelity.compiled_bytes_by_axes()
                predicted = fidelity.estimate.wire_bytes_by_axes()
                ctx = sum(b for axes, b in compiled.items() if CONTEXT in axes)
                model = sum(b for axes, b in predicted.items() if CONTEXT in axes)
                rows.append([
                    impl, c, seq, f"{ctx / 1e6:.1f}", f"{model / 1e6:.1f}",
                    f"{fidelity.compiled.memory.live_total / 2**20:.0f}", f"{fidelity.estimate.memory.peak / 2**20:.0f}",
                ])
    return [
        "Compiled against the analytic model (`jaxpar.analysis`, XLA:CPU lowering): a tiny Llama (hidden 256,",
        "8 heads and 8 KV heads of 32, 2 layers, vocab 256), one sequence per context group, data x context = 8,",
        "load-balanced, fp32. Context-axis bytes include the gradients' all-reduce over context (parameters are",
        "replicated over it), the same at every sequence length; the rest is attention's K/V traffic, linear in",
        "the sequence. Ulysses (all_to_all) moves q, k, v and the output but only S/c of each per device;",
        "ring moves the same K/V as all_gather plus the travelling dK/dV, in c - 1 neighbour steps.",
        "",
        *_table(
            ["impl", "context", "seq", "compiled context MB/device", "model MB", "compiled MiB", "model MiB"], rows
        ),
        "",
    ]


# ---- expert load balance ---------------------------------------------------------------------------


# Loss-free balancing's bias step per training step in the expert section (DeepSeek-V3 used 0.001
# over trillions of tokens; a 120-step run needs a larger one to move within it).
_BIAS_RATE = 0.01


def section_expert(steps: int) -> list[str]:
    import tempfile

    import numpy as np

    from jaxpar.axes import DATA, EXPERT
    from jaxpar.train.loop import train

    # (label, router options): softmax scores unless named; z-loss off throughout.
    settings = {
        "aux loss 0.01": dict(router_aux_loss_coef=0.01),
        "neither": dict(router_aux_loss_coef=0.0),
        f"bias {_BIAS_RATE} (sigmoid)": dict(
            router_aux_loss_coef=0.0, scoring_func="sigmoid", router_bias_update_rate=_BIAS_RATE
        ),
        "neither (sigmoid)": dict(router_aux_loss_coef=0.0, scoring_func="sigmoid"),
    }
    runs = {}
    for label, options in settings.items():
        config = with_mesh(config_file("mixtral_tiny"), {DATA: 4, EXPERT: 2}, model={**options, "router_z_loss_coef": 0.0},
                           train={"steps": steps})
        with tempfile.TemporaryDirectory() as workdir:
            start = time.perf_counter()
            history = train(config, workdir, progress=False)
        runs[label] = (history, time.perf_counter() - start)
    E, e = 4, 2
    rows = []
    for label, (history, seconds) in runs.items():
        window = max(1, len(history) // 5)
        shares = np.mean([h["expert_fraction"] for h in history[-window:]], axis=0)
        first = np.asarray(history[0]["expert_fraction"])
        device = shares.reshape(e, E // e).sum(axis=1)
        rows.append([
            label, " / ".join(f"{100 * x:.1f}" for x in first), " / ".join(f"{100 * x:.1f}" for x in shares),
            f"{shares.max() / shares.min():.2f}", " / ".join(f"{100 * x:.1f}" for x in device),
            f"{history[-1]['loss']:.3f}", f"{seconds:.0f}",
        ])
    return [
        "## 4. Expert load balance: auxiliary loss, loss-free bias, neither (article section 5.2)",
        "",
        f"`configs/mixtral_tiny.py` (4 experts, top-2, 3 layers) trained {steps} steps on the built-in",
        "corpus on 8 emulated devices, mesh data 4 x expert 2 (experts 0-1 on expert rank 0, 2-3 on rank 1), z-loss",
        "off: with the load-balancing coefficient 0.01; with neither balancing; with DeepSeek-V3's loss-free",
        f"balancing (sigmoid scores, a per-expert bias for the top-k choice moved {_BIAS_RATE} per step toward the",
        "layer's mean load, no aux loss); and with sigmoid scores but no bias, its control. Shares are of all",
        "(token, layer, expert) assignments, averaged over the last fifth of the run (step 1 for comparison).",
        "",
        *_table(["router", "step 1 % per expert", "end % per expert", "max/min", "% per expert rank", "final loss", "s"], rows),
        "",
        "The article reports GPU utilisation 92% vs 41% without the loss and 68-73% with it on Mixtral-8x7B, EP=4.",
        "Token shares are what balancing acts on: compare max/min above (1.00 is perfect balance). A short run",
        "from a random router starts near balance, so the gap measured here is what 120 steps develop, not",
        "a converged model's. The bias needs no gradient: it moves every step by the same amount whatever",
        "the loss, and adds no term to the loss the model is trained on.",
        "",
    ]


# ---- the 70B plan ----------------------------------------------------------------------------------


def section_plan() -> list[str]:
    from jaxpar.analysis.cost.cost_model import estimate
    from jaxpar.analysis.planner import report
    from jaxpar.analysis.planner.search import plan_layouts
    from jaxpar.axes import PIPELINE, TENSOR

    get_config = functools.partial(config_file, "llama3_70b")  # a fresh config per use
    start = time.perf_counter()
    text = report(get_config(), "a100-80g", 8, compare={TENSOR: 4, PIPELINE: 2})
    seconds = time.perf_counter() - start
    plan = plan_layouts(get_config(), "a100-80g", 32)  # the ranking the report shows for 32
    shipped = estimate(get_config(), "a100-80g", num_devices=32)
    rank, mine = plan.rank_of(shipped.layout.mesh)
    gap = mine.seconds / plan.best.seconds - 1
    return [
        "## 5. Llama-3-70B on 8 x A100-80G (article section 6)",
        "",
        "The article picks TP 4 x PP 2 for full training of Llama-3-70B on one 8 x A100-80G node, arguing from",
        "\"70B in FP16 is about 140 GB\". Training with AdamW keeps far more: fp32 master parameters (4 B), two",
        "fp32 moments (8 B), fp32 gradients (4 B) and a bf16 copy for the forward (2 B) per parameter, 18 B x 70.6B",
        "= 1.27 TB before any activation, against 8 x 80 GiB. `python scripts/plan.py",
        "--config=configs/llama3_70b.py --hardware=a100-80g --devices=8 --compare=tensor=4,pipeline=2` says",
        f"(analytic, {seconds:.0f} s on this machine):",
        "",
        "```",
        text,
        "```",
        "",
        "Read top to bottom: the first verdict is the honest answer to the article's question (no layout of 8",
        "A100-80G holds full-parameter AdamW training of 70B: parameters and moments alone overflow, whatever the",
        "split); the ranking is for the smallest A100 count that does hold it; the last block prices the article's",
        "TP 4 x PP 2 itself, on every profile at 8 devices and replicated over data where 70B fits. The article's",
        "reasons for it (TP inside NVLink, PP to cut memory) hold in the model, but on 8 devices they are moot. At",
        f"32 the winner is {plan.best.describe()}: with ZeRO-3's per-layer gathers and reductions priced behind",
        "compute (`jaxpar.analysis.cost.efficiency`), data parallelism across InfiniBand costs little, and tensor",
        f"parallelism stays inside a node. `configs/llama3_70b.py` ships {shipped.layout.describe()}, whose mesh ranks",
        f"{rank} ({100 * gap:+.0f}% step time): it was the peak-rate model's runner-up, before communication could hide.",
        "",
    ]


# ---- fidelity --------------------------------------------------------------------------------------


def section_fidelity(dirs: list[str]) -> list[str]:
    import csv

    lines = [
        "## 6. The cost model against compiled steps",
        "",
        "Each sweep compiles every layout preflight admits on emulated CPU devices (`scripts/sweep.py`, command and",
        "wall time in its sweep.md) and prices the same program analytically. Targets: peak memory within 15%,",
        "collective bytes per mesh axis within 10%.",
        "",
    ]
    lines += [
        "What comparing the model with compiled programs found in jaxpar (each priced by the model now, as",
        "`comm.jaxpar_quirks` or an XLA:CPU lowering rule, and each a candidate fix):",
        "",
        "- Interleaved pipeline schedules move every layer's parameters into stage order and the gradients back",
        "  each step (all-to-alls between rank pairs, plus permutes of the whole local stack beyond two ranks):",
        "  about 3x the rank's layer bytes per step at p = 4 and 8. Storing the stack in stage order removes it;",
        "  until then the planner prefers plain 1F1B.",
        "- MoE on XLA:CPU: the tiled expert loop reduces each tile's partial sums over tensor inside the loop, and",
        "  save_dots cannot see its dots (it recomputes the experts).",
        "- ZeRO-3 x tensor: the partitioner re-lays the embedding table for the lookup in shape-dependent ways",
        "  (an all-to-all of activations over data, or a permute plus a gather within tensor): listed, not priced.",
        "- Sequence parallelism with per-replica accumulation gathers each layer's inputs again per forward pass.",
        "- ZeRO-1 with an expert axis: the gradient reduce-scatter runs over data and then over expert; a small",
        "  all-reduce over data x expert per microbatch remains unpriced (the 89% rows in the Mixtral table below).",
        "- Mixtral with mesh tensor=8 and nothing else fails to compile (XLA SPMD RET_CHECK: a cross-partition",
        "  all-reduce outside manual partitioning), see the Mixtral sweep's last line.",
        "",
    ]
    if not dirs:
        return lines + ["(no sweeps given: pass --sweeps=DIR,...)", ""]
    for d in dirs:
        with open(os.path.join(d, "sweep.csv")) as f:
            rows = list(csv.DictReader(f))
        priced = [r for r in rows if r["memory_error"] != ""]
        mem = [abs(float(r["memory_error"])) for r in priced]
        ax = [float(r["max_axis_bytes_error"]) for r in priced]
        ok = sum(r["within_tolerance"] == "True" for r in priced)
        with open(os.path.join(d, "sweep.md")) as f:
            head = [line.strip() for line in f.read().splitlines()[:4] if line.strip()]
        lines += [
            f"### {head[0].lstrip('# ')}",
            "",
            *(h for h in head[1:]),
            "",
            f"{len(priced)} layouts: peak memory |error| max {100 * max(mem):.1f}%, mean {100 * sum(mem) / len(mem):.1f}%; "
            f"bytes per axis |error| max {100 * max(ax):.1f}%; {ok} of {len(priced)} within both targets. Full table, "
            f"the unexpected collectives and plots: [{d}/sweep.md]({os.path.relpath(d, 'docs')}/sweep.md), "
            f"![memory]({os.path.relpath(d, 'docs')}/memory.png)",
            "",
            *_table(
                ["layout", "compiled GiB", "model GiB", "memory error", "max axis error", "unexpected collectives"],
                [[r["layout"], f"{float(r['compiled_peak_bytes']) / GIB:.1f}", f"{float(r['predicted_peak_bytes']) / GIB:.1f}",
                  f"{100 * float(r['memory_error']):+.1f}%", f"{100 * float(r['max_axis_bytes_error']):.1f}%",
                  r["unexpected_collectives"] or "-"] for r in priced],
            ),
            "",
        ]
    return lines


def section_published(with_planner: bool) -> list[str]:
    from jaxpar.analysis.reports import published, published_fp8

    return published.section(with_planner=with_planner) + published_fp8.section()


def section_zero_context() -> list[str]:
    from jaxpar.analysis.reports.zero_memory import section

    return section(config_file("llama3_70b"), seq=131072, batch=64, hardware="h100-80g", n=128, compiled_seq=32768)


def _existing_sections(path: str) -> dict[int, list[str]]:
    """Section number -> its lines in an earlier docs/experiments.md (for --keep_others)."""
    out, number = {}, None
    for line in open(path).read().splitlines():
        if line.startswith("## "):
            number = int(line[3:].split(".")[0])
        if number is not None:
            out.setdefault(number, []).append(line)
    return out


def run(args, _) -> None:
    # Before JAX starts its backends: 8 emulated devices, LLVM at -O0 (compile time halves; the XLA graph,
    # its buffers and collectives, stay as they are).
    os.environ["XLA_FLAGS"] = " ".join([
        os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
    ]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.fit:
        from jaxpar.analysis.reports.published import FITTED, RUNS, fit_matmul_efficiency

        for profile, name in FITTED.items():
            print(f"{profile}: matmul_efficiency {fit_matmul_efficiency(next(r for r in RUNS if r.name == name)):.3f} ({name})")
        return
    sections = {
        "tp": section_tp, "pipeline": section_pipeline, "context": section_context,
        "expert": lambda: section_expert(args.expert_steps), "plan": section_plan,
        "fidelity": lambda: section_fidelity(args.sweeps), "published": lambda: section_published(args.published_planner),
        "zero_context": section_zero_context,
    }
    start = time.perf_counter()
    kept = _existing_sections(args.out) if args.keep_others else {}
    body = []
    for number, name in enumerate(SECTIONS if args.keep_others else args.sections, 1):
        if name not in args.sections:
            body += kept.get(number, [])
            continue
        t = time.perf_counter()
        body += sections[name]()
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
    kept = f"; only {','.join(args.sections)} regenerated, with --keep_others" if args.keep_others else ""
    header = [
        "# The article's experiments, measured with jaxpar",
        "",
        "Generated by `python scripts/experiments.py --out=docs/experiments.md"
        + (f" --sweeps={','.join(args.sweeps)}" if args.sweeps else "") + "` (do not edit by hand) on a 2-core",
        f"machine shared with other jobs ({time.perf_counter() - start:.0f} s{kept}). Source: the article \"{ARTICLE}\".",
        "Compiled figures are XLA:CPU on emulated devices; step times are the analytic model's for the named GPU.",
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(header + body) + "\n")
    print(f"wrote {args.out}")


def checks(args) -> list[str]:
    if args.keep_others and not os.path.isfile(args.out):
        return [f"--keep_others: {args.out} does not exist (nothing to keep)"]
    return [f"--sweeps={d}: no sweep.csv there" for d in args.sweeps if not os.path.isfile(os.path.join(d, "sweep.csv"))]


COMMANDS = (Command(None, "measure the source article's experiments and write docs/experiments.md", run, flags=FLAGS,
                    devices=False, checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
