"""`parallel.remat="auto"` on an accelerator: the fastest policy the cost model says fits.

On a CPU "auto" keeps its measured table (`jaxpar.parallel.plan.AUTO_REMAT`: full, which XLA:CPU runs
faster than saving residuals through the layer scan — a cost the model does not price). On a GPU or
TPU the table said "none" whatever the memory; instead each policy (none, save_dots, offload, full)
is priced on these devices' profile with their allocator's limit, and the fastest whose predicted
peak fits the planner's usable share of it wins; when none fits, full (the least memory), and the fit
check then says what does fit. `scripts/train.py` asks this before the run is built.
"""

from __future__ import annotations

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.planner.fit_advice import profile_for
from jaxpar.analysis.planner.search import USABLE_FRACTION

POLICIES = ("none", "save_dots", "offload", "full")


def choose(config, devices, available: int) -> tuple[str, str]:
    """(the remat policy for `config` on `devices` with `available` bytes each, one line saying why)."""
    hardware = profile_for(devices, available)
    usable = available * USABLE_FRACTION
    priced = {}
    for name in POLICIES:
        candidate = config.copy_and_resolve_references()
        candidate.parallel.remat = name
        est = estimate(candidate, hardware, num_devices=len(devices))
        priced[name] = (est.time.seconds, est.memory.peak)
    fitting = [name for name in POLICIES if priced[name][1] <= usable]
    table = ", ".join(f"{n} {s:.3g} s / {m / 2**30:.1f} GiB" for n, (s, m) in priced.items())
    if not fitting:
        return "full", f"parallel.remat=auto: full (no policy fits {usable / 2**30:.1f} GiB per device: {table})"
    best = min(fitting, key=lambda n: priced[n][0])
    return best, f"parallel.remat=auto: {best}, the fastest that fits {usable / 2**30:.1f} GiB per device ({table})"
