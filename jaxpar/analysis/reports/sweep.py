"""Compile every layout of a config on N devices and set the analytic model beside each.

`sweep(config, num_devices, hardware)` walks the layouts preflight admits
(`jaxpar.analysis.planner.candidates`, by default every mesh × ZeRO stage with the config's other knobs),
AOT-compiles the real train step of each on abstract inputs (`compiled.compile_step`: nothing is
allocated, so a 70B step compiles on emulated CPU devices) and prices it twice:

  predicted (target "cpu")  the same program as XLA:CPU lowers it: compared with the compiled
                            memory and collectives (the fidelity columns);
  predicted (hardware)      as the hardware's compiler would lower it: step time and fit.

`save(rows, path)` keeps the compiled side (memory, FLOPs, collectives; not the HLO text) so
`reprice(config, path, ...)` can set a changed model beside it without compiling again.
`records(rows)` are the rows of `sweep.csv`; `markdown(...)` the table and the fidelity summary,
including every collective XLA emitted that the model does not plan ("unexpected": a model gap or
a sharding bug in jaxpar). Layouts the model cannot price (a model hook raising
NotImplementedError; none today) are compiled and reported with empty predictions.

Compiled peak is arguments + non-aliased outputs + temporaries (`CompiledMemory.live_total`):
XLA:CPU's own `peak_memory_in_bytes` reports only the arguments.
"""

from __future__ import annotations

import dataclasses
import pickle
import time

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import Estimate, estimate
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.planner.candidates import Candidate, Screen, Space, candidates
from jaxpar.analysis.planner.search import USABLE_FRACTION, memory_terms
from jaxpar.analysis.program.compiled import CompiledStep, compile_step
from jaxpar.analysis.reports.fidelity import Fidelity
from jaxpar.axes import MESH_AXES

# Fidelity targets (the issue's): peak memory within 15%, collective bytes within 10%.
MEMORY_TOLERANCE = 0.15
BYTES_TOLERANCE = 0.10
# An axis carrying less than this share of a step's compiled bytes, compiled and predicted, is not
# held to BYTES_TOLERANCE (e.g. the pipeline's loss scalars: 4 bytes over data x pipeline).
MINOR_AXIS_SHARE = 0.001
# Collectives the model does not plan are listed from this many wire bytes per device and step
# (below it: scalars such as the loss and the MoE statistics, 4 to 100 bytes).
MIN_LISTED_BYTES = 1e6


@dataclasses.dataclass
class SweepRow:
    candidate: Candidate
    compiled: CompiledStep | None = None
    cpu: Estimate | None = None  # the model, XLA:CPU lowering (compare with `compiled`)
    target: Estimate | None = None  # the model, the hardware's lowering (time, fit)
    usable: float = 0.0
    error: str = ""  # compile failure, or why the model could not price it
    wall_seconds: float = 0.0

    @property
    def fidelity(self) -> Fidelity | None:
        return Fidelity(self.cpu, self.compiled) if self.cpu is not None and self.compiled is not None else None

    def axis_errors(self) -> dict:
        """Relative error of predicted wire bytes per mesh-axis set carrying, compiled or
        predicted, at least MINOR_AXIS_SHARE of the step's compiled bytes."""
        fid = self.fidelity
        if fid is None:
            return {}
        rows = fid.axis_bytes()
        total = sum(r.compiled for r in rows) or 1.0
        return {r.axes: r.error for r in rows if max(r.compiled, r.predicted) >= MINOR_AXIS_SHARE * total}

    @property
    def within_tolerance(self) -> bool | None:
        fid = self.fidelity
        if fid is None:
            return None
        return abs(fid.memory_error) <= MEMORY_TOLERANCE and all(abs(e) <= BYTES_TOLERANCE for e in self.axis_errors().values())


def sweep(config, num_devices: int, hardware="a100-80g", *, space: Space | None = None, devices=None,
          progress: bool = True, limit: int | None = None):
    """([SweepRow], Screen): every admitted layout (the first `limit`) compiled and priced."""
    from tqdm.auto import tqdm

    hardware = hw.get(hardware) if isinstance(hardware, str) else hardware
    space = space or Space.of_config()
    screen = Screen(config, num_devices)
    admitted = [(c, a) for c in candidates(config, num_devices, space) if (a := screen.admit(c)) is not None]
    rows = []
    bar = tqdm(admitted[:limit], desc=f"compile {num_devices} devices", disable=not progress, unit="layout")
    for candidate, applied in bar:
        bar.set_postfix_str(candidate.describe()[:60])
        rows.append(_one(candidate, applied, num_devices, hardware, devices))
    return rows, screen


def _one(candidate, applied, num_devices, hardware, devices) -> SweepRow:
    row = SweepRow(candidate, usable=USABLE_FRACTION * hardware.hbm_bytes)
    start = time.perf_counter()
    try:
        row.compiled = compile_step(applied, devices)
    except Exception as e:  # a layout XLA or jaxpar cannot compile is a finding, not a crash
        row.error = f"compile: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    _price(row, applied, num_devices, hardware)
    row.wall_seconds = time.perf_counter() - start
    return row


def _price(row: SweepRow, applied, num_devices: int, hardware) -> None:
    try:
        row.cpu = estimate(applied, num_devices=num_devices, target="cpu")
        row.target = estimate(applied, hardware, num_devices=num_devices)
    except NotImplementedError as e:
        row.error = row.error or f"model: {e}"


def save(rows: list[SweepRow], path: str) -> None:
    """The compiled side of each row (HLO text and the device mesh left out) for `reprice`."""
    kept = []
    for r in rows:
        c = r.compiled and dataclasses.replace(r.compiled, mesh=None, hlo_text=None)
        shape = tuple(r.compiled.mesh.devices.shape) if r.compiled else None
        compile_error = r.error if r.error.startswith("compile") else ""
        kept.append(dict(keys=r.candidate.keys, compiled=c, mesh_shape=shape, error=compile_error, wall=r.wall_seconds))
    with open(path, "wb") as f:
        pickle.dump(kept, f)


def reprice(config, path: str, num_devices: int, hardware="a100-80g", *, recompile=None) -> list[SweepRow]:
    """Rows from `save`d compiled results, priced by the model as it is now. `recompile(layout)`:
    true for the layouts whose code path changed since, which are compiled again."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxpar.axes import MESH_AXES as AXES

    hardware = hw.get(hardware) if isinstance(hardware, str) else hardware
    with open(path, "rb") as f:
        kept = pickle.load(f)
    rows = []
    for k in kept:
        candidate = Candidate(k["keys"])
        row = SweepRow(candidate, usable=USABLE_FRACTION * hardware.hbm_bytes, error=k["error"], wall_seconds=k["wall"])
        applied = candidate.apply(config)
        if recompile is not None and recompile(Layout.from_config(applied, num_devices)):
            rows.append(_one(candidate, applied, num_devices, hardware, None))
            continue
        if k["compiled"] is not None:
            # Collectives name logical device ids, so any mesh of the same shape reads them alike.
            devices = np.array(jax.devices()[:num_devices]).reshape(k["mesh_shape"])
            row.compiled = dataclasses.replace(k["compiled"], mesh=Mesh(devices, AXES))
        _price(row, applied, num_devices, hardware)
        rows.append(row)
    return rows


def _unexpected(fid: Fidelity) -> list:
    return [t for t in fid.unexpected(min_fraction=0.0) if t.wire_bytes >= MIN_LISTED_BYTES]


def _collectives_text(totals) -> str:
    return "; ".join(f"{t.kind}@{'+'.join(t.axes) or '-'}={t.wire_bytes:.4g}" for t in totals)


def record(row: SweepRow) -> dict:
    """One CSV row: layout keys, compiled figures, predictions, fidelity."""
    v, c, cpu, target, fid = row.candidate.values, row.compiled, row.cpu, row.target, row.fidelity
    out = {a: v[f"mesh.{a}"] for a in MESH_AXES}
    out.update(
        zero_stage=v.get("parallel.zero_stage"),
        remat=v.get("parallel.remat"),
        sequence_parallel=v.get("parallel.sequence_parallel", ""),
        schedule=v.get("parallel.pipeline_schedule", ""),
        microbatches=v.get("parallel.num_microbatches", ""),
        grad_accum=v.get("train.grad_accum", ""),
        layout=row.candidate.describe(),
        compile_s=round(c.compile_seconds, 1) if c else "",
        compiled_argument_bytes=c.memory.argument if c else "",
        compiled_temp_bytes=c.memory.temp if c else "",
        compiled_peak_bytes=c.memory.live_total if c else "",
        predicted_peak_bytes=cpu.memory.peak if cpu else "",
        memory_error=round(fid.memory_error, 4) if fid else "",
        compiled_matmul_flops=c.hlo_matmul_flops if c else "",
        predicted_matmul_flops=cpu.flops_per_device if cpu else "",
        compiled_collective_bytes=sum((fid.compiled_bytes_by_axes() if fid else c.wire_bytes_by_axes()).values()) if c else "",
        predicted_collective_bytes=sum(cpu.wire_bytes_by_axes().values()) if cpu else "",
        max_axis_bytes_error=round(max(map(abs, row.axis_errors().values()), default=0.0), 4) if fid else "",
        within_tolerance=row.within_tolerance if fid else "",
        compiled_collectives=_collectives_text(fid.compiled_totals() if fid else c.comm_totals()) if c else "",
        unexpected_collectives=_collectives_text(_unexpected(fid)) if fid else "",
        predicted_peak_bytes_hw=target.memory.peak if target else "",
        predicted_step_s=round(target.time.seconds, 4) if target else "",
        predicted_compute_s=round(target.time.compute, 4) if target else "",
        predicted_comm_s=round(target.time.comm, 4) if target else "",
        predicted_bubble_s=round(target.time.bubble, 4) if target else "",
        fits=(target.memory.peak <= row.usable) if target else "",
        error=row.error,
    )
    return out


def collective_records(row: SweepRow) -> list[dict]:
    """Per (kind, mesh axes): compiled and predicted wire bytes per device (long format)."""
    if row.compiled is None:
        return []
    predicted: dict = {}
    if row.cpu is not None:
        for p in row.cpu.collectives:
            if p.axes:
                key = (p.kind, p.axes)
                predicted[key] = predicted.get(key, 0.0) + p.wire_bytes(row.cpu.layout.mesh)
    totals = row.fidelity.compiled_totals() if row.fidelity else row.compiled.comm_totals()
    compiled = {(t.kind, t.axes): t for t in totals}
    out = []
    for kind, axes in sorted(set(compiled) | set(predicted)):
        t = compiled.get((kind, axes))
        out.append(dict(
            layout=row.candidate.describe(), kind=kind, axes="+".join(axes) or "-",
            instructions=t.instructions if t else 0, executions=t.executions if t else 0,
            compiled_wire_bytes=t.wire_bytes if t else 0.0, predicted_wire_bytes=predicted.get((kind, axes), ""),
            in_branch=t.in_branch if t else "",
        ))
    return out


def _gb(n) -> str:
    return f"{n / 2**30:.2f}" if n != "" and n is not None else ""


def _pct(x) -> str:
    return f"{100 * x:+.1f}%" if x != "" and x is not None else ""


def markdown(rows: list[SweepRow], screen: Screen, *, title: str, notes: list[str] = ()) -> str:
    lines = [f"# {title}", ""] + [f"{n}  " for n in notes] + [
        "",
        f"{len(rows)} layouts compiled; {screen.summary(5)}.",
        "",
        "Per device. *compiled*: XLA:CPU on emulated devices (arguments + outputs not aliased + temporaries); "
        "*predicted*: the analytic model for the same XLA:CPU program; *hw*: the model for the hardware's "
        "lowering (16-bit activations), which gives the step time and the fit.",
        "",
        "| layout | compiled GiB | predicted GiB | error | collectives compiled MB | predicted MB | max axis error "
        "| hw GiB | step s (compute / comm / bubble) | fits | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = record(row)
        step = (
            f"{r['predicted_step_s']:.3g} ({r['predicted_compute_s']:.3g} / {r['predicted_comm_s']:.3g} / {r['predicted_bubble_s']:.3g})"
            if r["predicted_step_s"] != "" else ""
        )
        mb = lambda x: f"{x / 1e6:,.0f}" if x != "" else ""  # noqa: E731
        lines.append(
            f"| {r['layout']} | {_gb(r['compiled_peak_bytes'])} | {_gb(r['predicted_peak_bytes'])} | {_pct(r['memory_error'])} "
            f"| {mb(r['compiled_collective_bytes'])} | {mb(r['predicted_collective_bytes'])} | {_pct(r['max_axis_bytes_error'])} "
            f"| {_gb(r['predicted_peak_bytes_hw'])} | {step} | {r['fits']} | {r['compile_s']} |"
        )
    lines += ["", *fidelity_summary(rows)]
    return "\n".join(lines) + "\n"


def fidelity_summary(rows: list[SweepRow]) -> list[str]:
    priced = [r for r in rows if r.fidelity is not None]
    out = ["## Fidelity", ""]
    if not priced:
        return out + ["No layout was both compiled and priced."]
    mem = [abs(r.fidelity.memory_error) for r in priced]
    axes = [abs(e) for r in priced for e in r.axis_errors().values()]
    ok = sum(bool(r.within_tolerance) for r in priced)
    out += [
        f"- peak memory: max |error| {100 * max(mem):.1f}%, mean {100 * sum(mem) / len(mem):.1f}% over {len(priced)} layouts "
        f"(target {MEMORY_TOLERANCE:.0%})",
        f"- collective bytes per mesh axis: max |error| {100 * max(axes, default=0):.1f}% (target {BYTES_TOLERANCE:.0%})",
        f"- within both targets: {ok} of {len(priced)}",
    ]
    for r in priced:
        if not r.within_tolerance:
            errs = ", ".join(f"{'+'.join(a)} {100 * e:+.1f}%" for a, e in r.axis_errors().items() if abs(e) > BYTES_TOLERANCE)
            out.append(f"  - outside: {r.candidate.describe()}: memory {100 * r.fidelity.memory_error:+.1f}%"
                       + (f"; bytes {errs}" if errs else ""))
    unexpected = [(r, t) for r in priced for t in _unexpected(r.fidelity)]
    out += ["", "Collectives XLA emitted that the model does not plan (kind over axes: bytes per device per step; "
            f"from {MIN_LISTED_BYTES / 1e6:g} MB):", ""]
    out += [f"- {r.candidate.describe()}: {t.kind} over {'+'.join(t.axes) or '-'}: {t.wire_bytes / 1e6:,.1f} MB "
            f"in {t.instructions} instructions" for r, t in unexpected] or ["- none"]
    failed = [r for r in rows if r.error]
    if failed:
        out += ["", "Not compiled or not priced:", ""] + [f"- {r.candidate.describe()}: {r.error}" for r in failed]
    return out


def memory_breakdown(row: SweepRow) -> list[tuple[str, int]]:
    return memory_terms(row.target.memory) if row.target else []
