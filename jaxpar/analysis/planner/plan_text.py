"""The planner's words: ranking tables, what limits the step (the vertex of the memory–compute–
communication triangle that binds: memory when faster layouts do not fit, else the largest part of
the step), why the winner wins, where the config's own layout stands, and the one-line `no mesh
fits` answer (`jaxpar.analysis.planner`)."""

from __future__ import annotations

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.planner.candidates import Candidate
from jaxpar.analysis.planner.search import (
    LAYOUT_KEYS,
    USABLE_FRACTION,
    Plan,
    Priced,
    memory_terms,
    overflow,
    param_total,
    plan_layouts,
    state_bytes_per_param,
)
from jaxpar.axes import DATA, MESH_AXES
from jaxpar.dtypes import DTYPE_BYTES
from jaxpar.mesh import MeshError, resolve_mesh_shape
from jaxpar.parallel.plan import resolve_remat
from jaxpar.train.preflight import ConfigError, check

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def mesh_text(mesh: dict) -> str:
    return " x ".join(f"{a} {s}" for a, s in mesh.items() if s > 1) or "1 device"


def comm_text(p: Priced, hardware: hw.Hardware) -> str:
    mesh, exposed = p.estimate.layout.mesh, p.estimate.time.exposed_by_axes
    parts = [
        f"{'+'.join(axes)} {_s(sec)} {hw.link_name(hardware, mesh, axes)}"
        + (f" ({_s(exposed[axes])} exposed)" if exposed[axes] < 0.995 * sec else "")
        for axes, sec in sorted(p.estimate.time.comm_by_axes.items(), key=lambda kv: -kv[1])
        if sec > 0
    ]
    return ", ".join(parts) or "none"


def time_split(p: Priced, hardware: hw.Hardware) -> str:
    t = p.estimate.time
    hidden = f", {_s(t.hidden)} of it hidden behind compute" if t.hidden > 0 else ""
    return (
        f"compute {_s(t.compute)} ({_pct(t.compute, t.seconds)}), communication {_s(t.comm)} "
        f"({_pct(t.exposed_comm, t.seconds)} exposed{hidden}: {comm_text(p, hardware)}), bubble {_s(t.bubble)} "
        f"({_pct(t.bubble, t.seconds)})"
    )


def memory_split(p: Priced, usable: float) -> str:
    terms = ", ".join(f"{name} {size / GIB:.1f}" for name, size in memory_terms(p.estimate.memory) if size > 0)
    return f"peak {gib(p.peak)} of {gib(usable)} usable ({terms} GiB)"


def header(config, hardware: hw.Hardware, num_devices: int, usable_fraction: float = USABLE_FRACTION) -> str:
    train = config.train
    total = param_total(config)
    per = state_bytes_per_param(config)
    pb = DTYPE_BYTES
    parts = [f"{train.param_dtype} parameters {pb[train.param_dtype]}", f"AdamW moments {2 * pb[train.param_dtype]}", "fp32 gradients 4"]
    if train.compute_dtype != train.param_dtype:
        parts.append(f"{train.compute_dtype} copy {pb[train.compute_dtype]}")
    usable = usable_fraction * hardware.hbm_bytes
    state = (f"state: {per:g} B per parameter ({' + '.join(parts)}) = {total * per / 1e12:.2f} TB before activations; "
             f"{num_devices} devices offer {num_devices * usable / 1e12:.2f} TB usable")
    if "lora" in train and int(train.lora.rank) > 0:  # jaxpar.models.lora: only the adapters train
        state = (f"state: LoRA rank {train.lora.rank} on {train.lora.targets}: the base frozen ({parts[0]}"
                 f"{', ' + parts[3] if len(parts) > 3 else ''}), gradients and AdamW moments of the adapters only; "
                 f"{num_devices} devices offer {num_devices * usable / 1e12:.2f} TB usable")
    return "\n".join([
        f"model: {config.model.model_type}, {total / 1e9:.1f}B parameters; global batch {train.global_batch_size} x "
        f"{train.seq_len} tokens; compute {train.compute_dtype}",
        f"hardware: {num_devices} x {hardware.name}: {gib(hardware.hbm_bytes)} HBM, {gib(usable)} usable per device "
        f"({usable_fraction:.0%}); {hardware.peak(train.compute_dtype) / 1e12:.0f} TFLOP/s {train.compute_dtype}; "
        f"{hardware.intra_node_link} {hardware.intra_node_bandwidth / 1e9:.0f} GB/s per direction within "
        f"{hardware.devices_per_node}-device nodes, {hardware.inter_node_link} {hardware.inter_node_bandwidth / 1e9:.1f} GB/s across",
        state,
    ])


def ranking(plan: Plan, top: int = 5) -> str:
    meshes = plan.best_per_mesh()
    lines = [
        f"{len(meshes)} meshes fit ({len(plan.fitting)} layouts of {len(plan.fitting) + len(plan.too_big)} priced; "
        f"{plan.screen.summary()}"
        + (f"; not priced: {sum(plan.unpriced.values())} ({next(iter(plan.unpriced))})" if plan.unpriced else "") + ")",
        f"{'#':>2}  {'layout':<52} {'step':>8} {'tok/s/dev':>9} {'MFU':>4}  {'compute':>8} {'comm':>8} {'exposed':>8} "
        f"{'bubble':>8}  {'peak GiB':>8}",
    ]
    for i, p in enumerate(meshes[:top]):
        t = p.estimate.time
        lines.append(
            f"{i + 1:>2}  {p.describe():<52} {_s(t.seconds):>8} {p.estimate.tokens_per_second_per_device:>9,.0f} "
            f"{p.estimate.mfu:>4.0%}  {_s(t.compute):>8} {_s(t.comm):>8} {_s(t.exposed_comm):>8} {_s(t.bubble):>8}  "
            f"{p.peak / GIB:>8.1f}"
        )
    return "\n".join(lines)


# ---- the triangle ------------------------------------------------------------------------------------


def _largest_time(p: Priced, hardware: hw.Hardware) -> str:
    """The largest part of the step and what would shorten it."""
    t = p.estimate.time
    part = max(("compute", t.compute), ("communication", t.exposed_comm), ("bubble", t.bubble), key=lambda kv: kv[1])[0]
    if part == "compute":
        return (
            f"compute, {_pct(t.compute, t.seconds)} of the step being matmul time "
            f"({p.estimate.flops_per_device / t.compute / 1e12:.0f} TFLOP/s achieved of "
            f"{hardware.peak(p.estimate.layout.compute_dtype_name) / 1e12:.0f}); only more devices, "
            "less recomputation or faster matmuls shorten it"
        )
    if part == "communication":  # the exposed part: what hides behind compute costs nothing
        axes, sec = max(p.estimate.time.exposed_by_axes.items(), key=lambda kv: kv[1])
        return (
            f"communication not hidden behind compute, {_pct(t.exposed_comm, t.seconds)} of the step, most of it over "
            f"{'+'.join(axes)} ({_s(sec)} on {hw.link_name(hardware, p.estimate.layout.mesh, axes)})"
        )
    return f"the pipeline bubble, {_pct(t.bubble, t.seconds)} of the step being idle ranks"


# A faster layout that overflows counts as evidence that memory binds only if it is this much faster.
MATERIAL = 0.02


def _crossing(memory, usable: float) -> str:
    names, total, over = overflow(memory, usable)
    return f"{gib(over)} over the {gib(usable)} usable once {names.split(' + ')[-1]} are added"


def binding(plan: Plan) -> str:
    best, hardware = plan.best, plan.hardware
    faster = [p for p in plan.too_big if p.seconds < (1 - MATERIAL) * best.seconds]
    within = _largest_time(best, hardware)
    if not faster:
        return (
            f"What limits the step: {within}. Not memory: no layout priced is more than "
            f"{MATERIAL:.0%} faster, fitting or not."
        )
    near = min(faster, key=lambda p: p.peak)
    return (
        f"What limits the choice: memory. {len(faster)} layouts priced are more than {MATERIAL:.0%} faster but do not fit; "
        f"the nearest to fitting, {near.describe()}, would take {_s(near.seconds)} "
        f"(-{_pct(best.seconds - near.seconds, best.seconds)}) but needs {gib(near.peak)} per device, "
        f"{_crossing(near.estimate.memory, plan.usable)}. To fit, the winner spends {_listing(_tradeoff(best, near))}. "
        f"Within what fits, the step is limited by {within}."
    )


def _tradeoff(a: Priced, b: Priced) -> list[tuple[float, str]]:
    """What `a` spends over `b`, component by component: [(seconds, what)], largest first,
    differences under 0.5% of a's step left out."""
    ta, tb = a.estimate.time, b.estimate.time
    out = [(ta.compute - tb.compute, f"compute{_compute_reason(a, b)}"),
           (ta.bubble - tb.bubble, f"pipeline bubble ({a.estimate.layout.bubble_fraction:.0%} idle)")]
    comm_a, comm_b = ta.exposed_by_axes, tb.exposed_by_axes  # what hides behind compute costs no time
    for axes in set(comm_a) | set(comm_b):
        link = hw.link_name(a.estimate.hardware, a.estimate.layout.mesh if axes in comm_a else b.estimate.layout.mesh, axes)
        out.append((comm_a.get(axes, 0.0) - comm_b.get(axes, 0.0), f"{'+'.join(axes)} communication over {link}"))
    return sorted([x for x in out if x[0] > 0.005 * ta.seconds], key=lambda x: -x[0])


def _listing(items: list[tuple[float, str]]) -> str:
    return "; ".join(f"{_s(sec)} more {what}" for sec, what in items) or "nothing measurable"


def _compute_reason(a: Priced, b: Priced) -> str:
    la, lb = a.estimate.layout, b.estimate.layout
    if la.p > 1 and lb.p == 1:
        return " (pipeline stages re-run their forward in the backward)"
    if la.remat != lb.remat:
        return f" (remat {la.remat} vs {lb.remat})"
    if la.t > lb.t and not la.kv_sharded:
        return f" (KV heads replicated over tensor {la.t})"
    return ""


def why_winner(plan: Plan) -> str:
    meshes = plan.best_per_mesh()
    if len(meshes) < 2:
        return "Why it wins: it is the only mesh that fits."
    best, second = meshes[0], meshes[1]
    gap = second.seconds - best.seconds
    saves = _tradeoff(best, second)
    return (
        f"Why it wins: the best layout on another mesh, {second.describe()}, takes {_s(second.seconds)} "
        f"(+{_pct(gap, best.seconds)}): it spends {_listing(_tradeoff(second, best))}"
        + (f", and saves {_listing(saves).replace(' more ', ' of ')}." if saves else ".")
    )


def _own_candidate(plan: Plan) -> Candidate | None:
    """The layout the config itself sets, on the plan's device count (None: its mesh cannot be built there)."""
    config = plan.config
    try:
        mesh = resolve_mesh_shape(config.mesh, plan.num_devices)
    except MeshError:
        return None
    values = {f"mesh.{axis}": size for axis, size in mesh.items()}
    for key in LAYOUT_KEYS:
        section, name = key.split(".", 1)
        if key not in values and name in config[section]:
            values[key] = config[section][name]
    # "auto" remat is what the run resolves for its backend: the one the layouts were priced for.
    target = plan.best.estimate.layout.target if plan.best is not None else "gpu"
    values["parallel.remat"] = resolve_remat(values["parallel.remat"], target)
    return Candidate(tuple(values.items()))


def own_layout(plan: Plan) -> str:
    """Where the config's own layout (what a run without `--plan` uses) stands beside the winner: its
    place and what the winner saves over it, or why it is not among the layouts that fit."""
    own, best = _own_candidate(plan), plan.best
    where = f"{plan.num_devices} x {plan.hardware.name}"
    if own is None:
        return f"The config's own mesh cannot be built on {plan.num_devices} devices; the winner's keys replace it."
    name = own.describe()
    if best is not None and name == best.describe():
        return f"The config's own layout, {name}, is the winner."
    priced = {p.describe(): p for p in plan.fitting + plan.too_big}
    if name in priced and priced[name].peak <= plan.usable:
        p = priced[name]
        place = sorted(q.seconds for q in plan.fitting).index(p.seconds) + 1
        spends = _tradeoff(p, best)
        why = f"it spends {_listing(spends)}" if spends else "no part of its step differs by 0.5% or more"
        return (
            f"The config's own layout, {name}, fits {where} and ranks {place} of the {len(plan.fitting)} layouts that fit: "
            f"{_s(p.seconds)}/step, +{_pct(p.seconds - best.seconds, best.seconds)} over the winner; {why}."
        )
    if name in priced:
        return (
            f"The config's own layout, {name}, does not fit {where}: it needs {gib(priced[name].peak)} per device, "
            f"{_crossing(priced[name].estimate.memory, plan.usable)}."
        )
    try:
        check(own.apply(plan.config), plan.num_devices)
    except ConfigError as e:
        return f"The config's own layout, {name}, is refused on {plan.num_devices} devices: {str(e).splitlines()[0]}"
    return f"The config's own layout, {name}, is not among the layouts the planner searches."


def choice(plan: Plan) -> str:
    """What `best_layout` prints: the winner, its split, what limits it, why it wins."""
    best = plan.best
    return "\n".join([
        f"plan for {plan.num_devices} x {plan.hardware.name}: {best.describe()}: {_s(best.seconds)}/step predicted, "
        f"{best.estimate.tokens_per_second:,.0f} tokens/s ({best.estimate.tokens_per_second_per_device:,.0f} per device), "
        f"MFU {best.estimate.mfu:.0%}",
        f"  time: {time_split(best, plan.hardware)}",
        f"  memory: {memory_split(best, plan.usable)}",
        f"  {binding(plan)}",
        f"  {why_winner(plan)}",
    ])


# ---- nothing fits ----------------------------------------------------------------------------------


def no_fit_line(plan: Plan, bigger: Plan | None) -> str:
    lean, hardware = plan.leanest, plan.hardware
    where = f"{plan.num_devices} x {hardware.name}"
    if lean is None:
        return f"no mesh fits {where}: preflight admits no layout ({plan.screen.summary()})"
    names, total, over = overflow(lean.estimate.memory, plan.usable)
    per = state_bytes_per_param(plan.config)
    smallest = (
        f"smallest {hardware.name} count on which a mesh fits: {bigger.num_devices}" if bigger
        else f"no {hardware.name} count up to 16384 fits"
    )
    return (
        f"no mesh fits {where}: the leanest layout ({lean.describe()}) needs {gib(lean.peak)} per device, and its "
        f"{names} alone reach {gib(total)}, {gib(over)} over the {gib(plan.usable)} usable "
        f"({per:g} B of state per parameter x {param_total(plan.config) / 1e9:.1f}B parameters); {smallest}"
    )


def discuss_mesh(config, hardware: hw.Hardware, small: Plan, fit: Plan | None, mesh: dict) -> str:
    """The given mesh (e.g. the article's tensor 4 x pipeline 2) on `small.num_devices` devices,
    on each hardware profile, and replicated over data on the device count that fits."""
    sizes = {a: mesh.get(a, 1) for a in MESH_AXES}
    n = 1
    for s in sizes.values():
        n *= s
    lines = [f"The {mesh_text(sizes)} mesh ({n} devices):"]
    fixed = [f"mesh.{a}" for a in MESH_AXES]
    for profile in hw.PROFILES.values():
        pinned = config.copy_and_resolve_references()
        pinned.mesh.update(sizes)
        try:
            plan = plan_layouts(pinned, profile, n, fixed=fixed)
        except hw.HardwareError as e:  # a profile without this compute dtype's peak: said here, not blamed on --hardware
            lines.append(f"  on {n} x {profile.name}: not priced ({e})")
            continue
        if plan.best is not None:
            lines.append(f"  on {n} x {profile.name}: fits; {plan.best.describe()}: {_s(plan.best.seconds)}/step, "
                         f"{memory_split(plan.best, plan.usable)}")
        elif plan.leanest is not None:
            names, total, over = overflow(plan.leanest.estimate.memory, plan.usable)
            lines.append(f"  on {n} x {profile.name}: does not fit; leanest {plan.leanest.describe()} needs "
                         f"{gib(plan.leanest.peak)} ({names}: {gib(over)} over {gib(plan.usable)})")
        else:
            lines.append(f"  on {n} x {profile.name}: preflight refuses it ({plan.screen.summary(1)})")
    if fit is None or fit.best is None:
        return "\n".join(lines)
    replicas = fit.num_devices // n
    extended = {**sizes, DATA: sizes[DATA] * replicas}
    found = fit.rank_of(extended)
    if found is None:
        lines.append(f"  replicated over data to {fit.num_devices} x {fit.hardware.name} ({mesh_text(extended)}): does not fit")
        return "\n".join(lines)
    rank, p = found
    best = fit.best
    verdict = "it is the winner" if rank == 1 else (
        f"rank {rank} of {len(fit.best_per_mesh())}: {_s(p.seconds)}/step, +{_pct(p.seconds - best.seconds, best.seconds)} "
        f"over the winner ({_listing(_tradeoff(p, best))})"
    )
    lines.append(
        f"  replicated over data to {fit.num_devices} x {fit.hardware.name}, best as {p.describe()}: {verdict}; "
        f"{memory_split(p, fit.usable)}"
    )
    return "\n".join(lines)
