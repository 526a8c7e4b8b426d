"""The layout planner: which mesh, ZeRO stage, remat and microbatching to train a config with on N
devices of given hardware.

- `candidates`: the layouts of a config on N devices (mesh x ZeRO x remat x SP x microbatches x
  schedule), screened by preflight.
- `search`: ranks the layouts that fit by the cost model; `plan_text` explains the choice.
- `fit_advice`: the way out when the training loop's fit check (`jaxpar.train.fit`) stops a run.

`best_layout(config, hardware, n, fixed=...)` (here) is what `scripts/train.py --plan=HARDWARE` calls:
the winner's config keys and a few lines saying which vertex of the memory–compute–communication
triangle binds and why the winner wins; keys in `fixed` (those given on the command line) keep
their values, and the search only ranks layouts that agree with them. When nothing fits it raises
`PlanError` whose one-line message starts `no mesh fits` and names the memory term that overflows,
by how much, and the smallest device count of that hardware on which some layout fits.

`report(...)` is what `scripts/plan.py` prints.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.planner import plan_text
from jaxpar.analysis.planner.candidates import get_key, set_keys
from jaxpar.analysis.planner.search import LAYOUT_KEYS, plan_layouts, smallest_fitting_plan
from jaxpar.axes import MESH_AXES
from jaxpar.train.preflight import ConfigError, check


class PlanError(ValueError):
    """No layout fits (the message is one line starting `no mesh fits`)."""


def refused_everywhere(config, fixed: Iterable[str] = ()) -> list[str]:
    """Preflight's problems that no layout the planner may choose cures (a fixed mesh axis the heads
    do not divide, a bad model key), found before any search: the config checked on the leanest
    layout that keeps the `fixed` keys (the other mesh axes 1, ZeRO, sequence parallelism and
    accumulation off, a pipeline 1F1B with one microbatch per stage), keeping the lines that name
    no layout key the search may still change. Without this, a search over every device count
    (`smallest_fitting_plan`) could run for minutes to find nothing."""
    fixed = set(fixed)
    leanest = {f"mesh.{axis}": max(int(get_key(config, f"mesh.{axis}")), 1) if f"mesh.{axis}" in fixed else 1
               for axis in MESH_AXES}
    leanest.update({"parallel.zero_stage": 0, "parallel.sequence_parallel": False, "train.grad_accum": 1})
    if leanest["mesh.pipeline"] > 1:
        leanest.update({"parallel.pipeline_schedule": "1f1b", "parallel.num_microbatches": leanest["mesh.pipeline"],
                        "parallel.virtual_stages": 1})
    config = set_keys(copy.deepcopy(config), {k: v for k, v in leanest.items() if k not in fixed})
    try:
        check(config, math.prod(leanest[f"mesh.{axis}"] for axis in MESH_AXES))
    except ConfigError as e:
        free = [key for key in LAYOUT_KEYS if key not in fixed]
        return [line for line in str(e).splitlines() if not any(key in line for key in free)]
    return []


def best_plan(config, hardware, num_devices: int, *, fixed: Iterable[str] = (), efficiency: float | None = None):
    """The ranked `Plan` whose `best` fits; raises PlanError (one line, starting `no mesh fits`)
    when nothing does, ConfigError when no layout could pass preflight (`refused_everywhere`)."""
    if problems := refused_everywhere(config, fixed):
        raise ConfigError("\n".join(problems))
    plan = plan_layouts(config, hardware, num_devices, fixed=fixed, efficiency=efficiency)
    if plan.best is None:
        bigger = smallest_fitting_plan(config, hardware, num_devices, fixed=fixed, efficiency=efficiency)
        raise PlanError(plan_text.no_fit_line(plan, bigger))
    return plan


def best_layout(config, hardware, num_devices: int, *, fixed: Iterable[str] = (), efficiency: float | None = None):
    """(config keys of the fastest layout that fits, explanation). Keys in `fixed` keep the
    config's value. Raises PlanError (one line, starting `no mesh fits`) when nothing fits."""
    plan = best_plan(config, hardware, num_devices, fixed=fixed, efficiency=efficiency)
    keys = {k: v for k, v in plan.best.candidate.values.items() if k not in set(fixed)}
    return keys, plan_text.choice(plan)


def prediction_line(plan) -> str:
    """What the run will be measured against: the winner's predicted step time, tokens/s and MFU
    in the units of metrics.jsonl (`step_s`, `tokens_per_sec` for all devices, `mfu`)."""
    est = plan.best.estimate
    return (
        f"predicted for {plan.num_devices} x {plan.hardware.name}: step_s {est.time.seconds:.4g}, tokens_per_sec "
        f"{est.tokens_per_second:,.0f} ({est.tokens_per_second_per_device:,.0f} per device), mfu {est.mfu:.3f} "
        "(metrics.jsonl logs the measured fields with predicted_step_s beside them)"
    )


def apply_layout(config, keys: dict, explicit: Iterable[str] = ()):
    """Sets `keys` in `config` (in place; a locked ConfigDict allows it) except those in
    `explicit`; returns `config`."""
    explicit = set(explicit)
    return set_keys(config, {k: v for k, v in keys.items() if k not in explicit})


_CONFIG_FLAG = re.compile(r"^--config\.([\w.]+)(=|$)")


def command_line_keys(argv: Iterable[str]) -> set[str]:
    """Config keys set on a command line (`--config.mesh.tensor=4` or `--config.mesh.tensor 4`)."""
    return {m.group(1) for m in map(_CONFIG_FLAG.match, argv) if m}


def report(config, hardware, num_devices: int, *, top: int = 5, compare: dict | None = None, fixed=(), efficiency=None) -> str:
    """Everything `scripts/plan.py` prints; ConfigError when no layout could pass preflight."""
    hardware = hw.get(hardware) if isinstance(hardware, str) else hardware
    if problems := refused_everywhere(config, fixed):
        raise ConfigError("\n".join(problems))
    plan = plan_layouts(config, hardware, num_devices, fixed=fixed, efficiency=efficiency)
    out = [plan_text.header(config, hardware, num_devices), ""]
    ranked = plan
    if plan.best is None:
        ranked = smallest_fitting_plan(config, hardware, num_devices, fixed=fixed, efficiency=efficiency)
        out.append(plan_text.no_fit_line(plan, ranked))
        if ranked is None:
            return "\n".join(out)
        out += ["", f"Ranking for {ranked.num_devices} x {hardware.name}:"]
    out += [plan_text.ranking(ranked, top), "", plan_text.choice(ranked), f"  {plan_text.own_layout(ranked)}"]
    if compare:
        out += ["", plan_text.discuss_mesh(config, hardware, plan, ranked, compare)]
    if efficiency is None:
        out += ["", "(step time = matmuls at the efficiency their shapes reach and attention at its kernel's "
                    "(jaxpar.analysis.cost.efficiency) + communication at link bandwidth, ZeRO-3's per-layer gathers and "
                    "reductions and the context ring hidden behind compute where it is long enough + pipeline bubble)"]
    else:
        peak = "at peak FLOP/s (optimistic)" if efficiency == 1 else f"at {efficiency:g} x peak FLOP/s"
        out += ["", f"(step time = matmuls {peak} + communication at link bandwidth, not overlapped with compute "
                    "(pessimistic) + pipeline bubble)"]
    return "\n".join(out)
