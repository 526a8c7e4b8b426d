"""What ZeRO over data x context saves on Llama 3 70B at long sequences, compiled and as the planner ranks it.

`compiled_rows(config, layouts)` compiles jaxpar's real step (abstract inputs, 8 emulated devices) for
each layout twice, with `parallel.zero_axes` "data" and "data+context", and returns the per-device
bytes of both (`CompiledMemory.live_total`) beside the model's prediction. `planner_rows(config,
hardware, n)` ranks the layouts of `config` on n devices of `hardware` (`jaxpar.analysis.planner.search`) and,
for the fastest ones using context parallelism with ZeRO, prices each again with ZeRO over data
alone. `section(...)` is what scripts/experiments.py writes into docs/experiments.md.
"""

from __future__ import annotations

import copy

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.planner.candidates import ZERO_AXES_KEY, set_keys
from jaxpar.analysis.planner.search import plan_layouts
from jaxpar.analysis.reports.markdown import table as _table
from jaxpar.axes import CONTEXT, DATA, MESH_AXES, TENSOR

GIB = 2**30
OVER_BOTH = f"{DATA}+{CONTEXT}"
# The 8-device meshes with context parallelism and ZeRO that the compiled comparison uses.
LAYOUTS = (
    ({DATA: 2, CONTEXT: 4}, 1), ({DATA: 2, CONTEXT: 4}, 3),
    ({DATA: 4, CONTEXT: 2}, 1), ({DATA: 4, CONTEXT: 2}, 3),
    ({DATA: 2, CONTEXT: 2, TENSOR: 2}, 1), ({DATA: 2, CONTEXT: 2, TENSOR: 2}, 3),
)


def _with(config, mesh: dict, stage: int, axes: str):
    c = copy.deepcopy(config)
    c.mesh.update({a: mesh.get(a, 1) for a in MESH_AXES})
    c.parallel.update(zero_stage=stage, zero_axes=axes, sequence_parallel=mesh.get(TENSOR, 1) > 1)
    return c


def compiled_rows(config, layouts=LAYOUTS) -> list[list[str]]:
    from jaxpar.analysis.program.compiled import compile_step

    rows = []
    for mesh, stage in layouts:
        measured, modelled, name = {}, {}, ""
        for axes in (DATA, OVER_BOTH):
            c = _with(config, mesh, stage, axes)
            measured[axes] = compile_step(c).memory.live_total
            est = estimate(c, num_devices=8, target="cpu")
            modelled[axes], name = est.memory.peak, est.layout.describe()
        saved = 1 - measured[OVER_BOTH] / measured[DATA]
        rows.append([
            name.replace("@dxc", ""), f"{measured[DATA] / GIB:.1f}", f"{measured[OVER_BOTH] / GIB:.1f}",
            f"{(measured[DATA] - measured[OVER_BOTH]) / GIB:.1f} ({100 * saved:.0f}%)",
            f"{(modelled[DATA] - modelled[OVER_BOTH]) / GIB:.1f}",
        ])
    return rows


def planner_rows(config, hardware: str, n: int, top: int = 5) -> list[list[str]]:
    plan = plan_layouts(config, hardware, n)
    out = []
    for p in plan.best_per_mesh():
        if p.candidate.mesh[CONTEXT] == 1 or not p.candidate.get("parallel.zero_stage"):
            continue
        alone = set_keys(p.candidate.apply(config), {ZERO_AXES_KEY: DATA})
        other = estimate(alone, hardware, num_devices=n)
        est = p.estimate
        out.append([
            p.describe(), f"{est.time.seconds:.3g}", f"{est.memory.peak / GIB:.1f}", f"{other.memory.peak / GIB:.1f}",
            f"{(other.memory.peak - est.memory.peak) / GIB:.1f}", f"{other.time.seconds:.3g}",
            "yes" if other.memory.peak <= plan.usable else "no",
        ])
        if len(out) == top:
            break
    return out



def section(config, seq: int, batch: int, hardware: str, n: int, compiled_seq: int) -> list[str]:
    ranked = copy.deepcopy(config)
    ranked.train.update(seq_len=seq, global_batch_size=batch, grad_accum=1)
    small = copy.deepcopy(config)
    small.train.update(seq_len=compiled_seq, global_batch_size=4, grad_accum=1)
    small.parallel.update(remat="full")
    return [
        "## 8. ZeRO over data x context on Llama 3 70B at long sequences",
        "",
        "With context parallelism every gradient is a sum over data x context anyway; `parallel.zero_axes` (default",
        "\"auto\": data x context whenever mesh.context > 1, except ZeRO-3 with a pipeline) splits the optimizer state,",
        "and at stage 3 the parameters, over both, as Megatron's distributed optimizer does over DP x CP.",
        "",
        f"Compiled (8 emulated devices, abstract inputs, bf16 compute with fp32 state, sequence {compiled_seq}, global",
        "batch 4, remat full): per-device bytes of jaxpar's step with ZeRO over data alone and over data x context,",
        "and the saving the cost model predicts for the same programs.",
        "",
        *_table(["layout", "over data GiB", "over data x context GiB", "saved", "model's saving GiB"], compiled_rows(small)),
        "",
        f"The planner's fastest layouts with context parallelism and ZeRO for {n} x {hardware} at sequence {seq},",
        f"global batch {batch} (`scripts/plan.py`), and each priced again with ZeRO over data alone:",
        "",
        *_table(
            ["layout (ZeRO over data x context)", "step s", "peak GiB", "peak over data alone GiB", "saved GiB",
             "step s over data alone", "fits over data alone"],
            planner_rows(ranked, hardware, n),
        ),
        "",
    ]
