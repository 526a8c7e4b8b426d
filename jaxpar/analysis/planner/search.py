"""The planner's search: every layout of a config on N devices priced by the analytic cost model
(`jaxpar.analysis.cost.cost_model`), those that fit ranked fastest first.

`plan_layouts(config, hardware, n)` prices every layout preflight admits
(`jaxpar.analysis.planner.candidates`). A layout fits when its predicted per-device peak is at most
`USABLE_FRACTION` of the device's HBM. Meshes whose leanest variant (remat full, sequence
parallel, the most microbatches; every ZeRO stage and schedule) does not fit are not priced
further: the other variants of a mesh need more memory. Without a pipeline, gradient
accumulation only costs time, so per (ZeRO, remat, SP) only the fewest microbatches that fit
are priced.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import re
from collections.abc import Iterable

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import Estimate, estimate
from jaxpar.analysis.cost.layout import shared_model
from jaxpar.analysis.cost.memory import MemoryEstimate
from jaxpar.analysis.cost.optimizer_terms import state_bytes_per_param as optimizer_state_per_param
from jaxpar.analysis.planner.candidates import (
    ACCUM_KEY,
    CONTEXT_IMPL_KEY,
    MICROBATCH_KEY,
    ZERO_AXES_KEY,
    Candidate,
    Screen,
    Space,
    candidates,
)
from jaxpar.axes import MESH_AXES, PIPELINE
from jaxpar.dtypes import DTYPE_BYTES
from jaxpar.models.families import facts

# Of each device's HBM, what a layout may plan to use: the rest is the CUDA context, cuBLAS /
# cuDNN workspaces, NCCL buffers and allocator fragmentation, and the model's own error (it is
# checked to 15% on CPU, not yet on a GPU). JAX preallocates 75% unless
# XLA_PYTHON_CLIENT_MEM_FRACTION is raised; set it to 0.95 for these layouts.
USABLE_FRACTION = 0.9

# The planner's search: every knob where it matters, three microbatch counts per pipeline mesh.
PLANNER_SPACE = Space(microbatch_options=3)

# Layout keys the planner may set (what `best_layout` returns a subset of).
LAYOUT_KEYS = tuple(f"mesh.{a}" for a in MESH_AXES) + (
    "parallel.zero_stage", "parallel.remat", "parallel.sequence_parallel", "parallel.pipeline_schedule",
    "parallel.num_microbatches", "parallel.virtual_stages", "train.grad_accum", "parallel.context_impl",
    "parallel.zero_axes", "parallel.context_latent",
)


@dataclasses.dataclass(frozen=True)
class Priced:
    candidate: Candidate
    estimate: Estimate

    @property
    def seconds(self) -> float:
        return self.estimate.time.seconds

    @property
    def peak(self) -> int:
        return self.estimate.memory.peak

    @property
    def mesh_key(self) -> tuple:
        return tuple(self.candidate.mesh.items())

    def describe(self) -> str:
        return self.candidate.describe()


@dataclasses.dataclass
class Plan:
    config: object
    hardware: hw.Hardware
    num_devices: int
    usable: float  # bytes per device a layout may use
    fitting: list  # [Priced], fastest first
    too_big: list  # [Priced] priced but over `usable` (with each pruned mesh's leanest variant)
    screen: Screen
    unpriced: collections.Counter  # reason -> count (layouts the model cannot price yet)

    @property
    def best(self) -> Priced | None:
        return self.fitting[0] if self.fitting else None

    @property
    def leanest(self) -> Priced | None:
        everything = self.fitting + self.too_big
        return min(everything, key=lambda p: p.peak) if everything else None

    def best_per_mesh(self) -> list:
        """The fastest fitting variant of each mesh, fastest first."""
        seen, out = set(), []
        for p in self.fitting:
            if p.mesh_key not in seen:
                seen.add(p.mesh_key)
                out.append(p)
        return out

    def rank_of(self, mesh: dict) -> tuple[int, Priced] | None:
        """(1-based rank among meshes, best variant) of the mesh with these sizes."""
        key = tuple({a: mesh.get(a, 1) for a in MESH_AXES}.items())
        for i, p in enumerate(self.best_per_mesh()):
            if p.mesh_key == key:
                return i + 1, p
        return None


def _hardware(hardware) -> hw.Hardware:
    return hw.get(hardware) if isinstance(hardware, str) else hardware


def _lean_ones(group: list) -> list:
    """The leanest knobs of one mesh's candidates: remat full, sequence parallel where it applies,
    the most microbatches."""
    def count(c):
        return c.get(MICROBATCH_KEY) if c.mesh[PIPELINE] > 1 else c.get(ACCUM_KEY, 1)

    most = max(count(c) for c in group)
    remats = {c.get("parallel.remat") for c in group}
    lean = [
        c for c in group
        if count(c) == most
        and (c.get("parallel.remat") == "full" or "full" not in remats)
        and c.get("parallel.sequence_parallel") is not False
    ]
    return lean or group


def plan_layouts(
    config,
    hardware,
    num_devices: int,
    *,
    space: Space = PLANNER_SPACE,
    fixed: Iterable[str] = (),
    efficiency: float | None = None,
    usable_fraction: float = USABLE_FRACTION,
) -> Plan:
    with _rare_collections():
        return _plan_layouts(config, _hardware(hardware), num_devices, space, fixed, efficiency, usable_fraction)


# A search allocates millions of short-lived objects that reference counting frees; the cyclic
# collector's young-generation passes every 700 allocations were a fifth of its time.
@contextlib.contextmanager
def _rare_collections(young: int = 100_000):
    """The collector's young generation collected every `young` allocations (restored after)."""
    threshold = gc.get_threshold()
    gc.set_threshold(max(young, threshold[0]), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


def _plan_layouts(config, hardware, num_devices, space, fixed, efficiency, usable_fraction) -> Plan:
    usable = usable_fraction * hardware.hbm_bytes
    screen, unpriced = Screen(config, num_devices), collections.Counter()
    fitting, too_big = [], []

    # A mesh's lean candidates are priced first and again with the rest (`_price_groups`): the second
    # time takes the first's answer, and counts its refusal again as before (the printed counts).
    outcomes: dict = {}  # candidate -> Priced, or (counter, reason) of its refusal

    def price(candidate) -> Priced | None:
        if candidate in outcomes:
            outcome = outcomes[candidate]
            if isinstance(outcome, Priced):
                return outcome
            counter, reason = outcome
            counter[reason] += 1
            return None
        applied = screen.admit(candidate)
        if applied is None:
            outcomes[candidate] = (screen.refused, screen.last_refusal)
            return None
        try:
            outcomes[candidate] = Priced(candidate, estimate(applied, hardware, num_devices=num_devices, efficiency=efficiency))
        except NotImplementedError as e:  # a model hook for a feature not priced yet (none today)
            reason = re.sub(r"\d+", "N", str(e))
            unpriced[reason] += 1
            outcomes[candidate] = (unpriced, reason)
            return None
        return outcomes[candidate]

    groups = collections.defaultdict(list)
    for c in candidates(config, num_devices, space, fixed):
        groups[tuple(c.mesh.items())].append(c)
    with shared_model(config), screen.sharing():  # every candidate shares config's model section (`Candidate.apply`)
        _price_groups(groups, price, usable, fitting, too_big)
    # Ties (equal predicted time): less memory first, then fewer microbatches.
    fitting.sort(key=lambda p: (p.seconds, p.peak))
    return Plan(config, hardware, num_devices, usable, fitting, too_big, screen, unpriced)


def _price_groups(groups: dict, price, usable: float, fitting: list, too_big: list) -> None:
    """Prices each mesh's candidates (`groups`: mesh -> [Candidate]) into `fitting` and `too_big`."""
    for group in groups.values():
        lean = [p for p in map(price, _lean_ones(group)) if p is not None]
        if lean and min(p.peak for p in lean) > usable:
            too_big.append(min(lean, key=lambda p: p.peak))
            continue
        fit_accum = set()  # (zero, remat, sp, impl): without a pipeline more accumulation only costs
        for c in group:
            knobs = (
                c.get("parallel.zero_stage"), c.get("parallel.remat"), c.get("parallel.sequence_parallel"),
                c.get(CONTEXT_IMPL_KEY), c.get(ZERO_AXES_KEY),
            )
            if c.mesh[PIPELINE] == 1 and knobs in fit_accum:
                continue
            p = price(c)
            if p is None:
                continue
            if p.peak <= usable:
                fitting.append(p)
                if c.mesh[PIPELINE] == 1:
                    fit_accum.add(knobs)
            else:
                too_big.append(p)


def state_bytes_per_param(config) -> float:
    """Parameters + the optimizer record's state + fp32 gradients (+ the compute-dtype copy) per parameter."""
    pb, cb = DTYPE_BYTES[config.train.param_dtype], DTYPE_BYTES[config.train.compute_dtype]
    return pb + optimizer_state_per_param(config) + 4 + (cb if cb != pb else 0)


def device_counts_after(num_devices: int, hardware: hw.Hardware, limit: int = 16384) -> list[int]:
    """Device counts to try above `num_devices`: powers of two within a node, whole nodes beyond."""
    node = hardware.devices_per_node
    counts = {2**k for k in range(limit.bit_length()) if 2**k < node} | set(range(node, limit + 1, node))
    return sorted(n for n in counts if num_devices < n <= limit)


def smallest_fitting_plan(config, hardware, num_devices: int, **kwargs) -> Plan | None:
    """The plan for the smallest device count above `num_devices` on which some layout fits."""
    hardware = _hardware(hardware)
    total = param_total(config)
    usable = kwargs.get("usable_fraction", USABLE_FRACTION) * hardware.hbm_bytes
    for n in device_counts_after(num_devices, hardware):
        if total * state_bytes_per_param(config) / n > usable:  # even fully sharded state overflows
            continue
        plan = plan_layouts(config, hardware, n, **kwargs)
        if plan.best is not None:
            return plan
    return None


def param_total(config) -> int:
    return facts(config.model).params_total


# ---- memory terms ----------------------------------------------------------------------------------


def memory_terms(memory: MemoryEstimate) -> list[tuple[str, int]]:
    """The peak split into the terms the reports name, in the order they are added."""
    activations = memory.temp - memory.backward_grads - memory.param_cast
    return [
        ("parameters", memory.params),
        ("optimizer state", memory.optimizer),
        ("gradients", memory.backward_grads),
        ("compute-dtype copy", memory.param_cast),
        ("activations and work buffers", activations),
    ]


def overflow(memory: MemoryEstimate, usable: float) -> tuple[str, float, float]:
    """(the terms up to the one that crosses `usable`, their sum, the excess over `usable`)."""
    total, names = 0, []
    for name, size in memory_terms(memory):
        if size <= 0:
            continue
        total += size
        names.append(name)
        if total > usable:
            break
    return " + ".join(names), total, total - usable


