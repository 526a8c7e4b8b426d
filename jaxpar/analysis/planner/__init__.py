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

import re
from collections.abc import Iterable

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.planner import plan_text
from jaxpar.analysis.planner.candidates import set_keys
from jaxpar.analysis.planner.search import plan_layouts, smallest_fitting_plan


class PlanError(ValueError):
    """No layout fits (the message is one line starting `no mesh fits`)."""


def best_plan(config, hardware, num_devices: int, *, fixed: Iterable[str] = (), efficiency: float | None = None):
    """The ranked `Plan` whose `best` fits; raises PlanError (one line, starting `no mesh fits`)
    when nothing does."""
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
    """Everything `scripts/plan.py` prints."""
    hardware = hw.get(hardware) if isinstance(hardware, str) else hardware
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
