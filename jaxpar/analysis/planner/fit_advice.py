"""What to do when the step does not fit: the planner's best layout for the devices at hand.

`advice(config, devices, available)` is the second half of the line scripts/train.py prints when the
fit check (`jaxpar.train.fit`) stops a run: the planner (`jaxpar.analysis.planner.search`) ranks the layouts of
`config` on these devices with `available` bytes each (the allocator's limit on a GPU or TPU, the
host's available memory shared by emulated CPU devices) and names the fastest that fits, or, when
none does, the smallest device count of this kind on which one does.

The devices' profile: a GPU or TPU is matched to `hardware.PROFILES` by its device kind (FLOP/s and
links from the profile, memory from the device); emulated CPU devices get a profile of their own
whose time figures are nominal (the ranking on CPU is by the CPU lowering's memory first: every
layout that fits runs on the same cores).
"""

from __future__ import annotations

import dataclasses

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.planner.search import device_counts_after, param_total, plan_layouts, state_bytes_per_param

# Device kinds (substrings of `device.device_kind`) to profiles, first match wins.
KINDS = (("H200", hw.H200), ("H100", hw.H100_80G), ("A100", hw.A100_80G), ("TPU v5p", hw.TPU_V5P))
# Device counts the search for a bigger fleet prices at most (each is a whole planner run).
MAX_COUNTS_PRICED = 3


def profile_for(devices, available: int) -> hw.Hardware:
    """The profile of `devices` with `available` bytes each (see the module doc)."""
    device = devices[0]
    if device.platform == "cpu":
        nominal = {dtype: 1e11 for dtype in ("float32", "bfloat16", "float16")}
        return hw.Hardware(
            name="cpu", peak_flops=nominal, hbm_bytes=available, hbm_bandwidth=1e10, intra_node_bandwidth=1e10,
            inter_node_bandwidth=1e10, devices_per_node=len(devices), intra_node_link="host", inter_node_link="host",
            kind="cpu",
        )
    for kind, profile in KINDS:
        if kind in device.device_kind:
            return dataclasses.replace(profile, hbm_bytes=available)
    raise hw.HardwareError(f"no profile for device kind {device.device_kind!r}")


def _flags(plan) -> str:
    return " ".join(f"--config.{k}={v}" for k, v in sorted(plan.best.candidate.values.items()))


def advice(config, devices, available: int) -> str:
    """One clause: the planner's best layout that fits these devices, or the smallest count that does."""
    hardware = profile_for(devices, available)
    n = len(devices)
    plan = plan_layouts(config, hardware, n, usable_fraction=1.0)
    if plan.best is not None:
        return f"the planner's best layout that fits {n} x {hardware.name} devices: {plan.best.describe()} ({_flags(plan)})"
    per_param, total = state_bytes_per_param(config), param_total(config)
    # Counts below the one where the fully sharded state alone fits are skipped unpriced.
    counts = [c for c in device_counts_after(n, hardware) if total * per_param / c <= available]
    for count in counts[:MAX_COUNTS_PRICED]:
        bigger = plan_layouts(config, hardware, count, usable_fraction=1.0)
        if bigger.best is not None:
            return (
                f"no layout fits {n} devices; the smallest {hardware.name} count with {available / 2**30:.1f} GiB each "
                f"on which one fits is {count}: {bigger.best.describe()}"
            )
    tried = f"{counts[0]} to {counts[MAX_COUNTS_PRICED - 1]}" if len(counts) >= MAX_COUNTS_PRICED else "any count up to 16384"
    return (
        f"no layout fits {n} devices, nor {tried} devices of {available / 2**30:.1f} GiB "
        f"({per_param:g} B of state per parameter x {total / 1e9:.1f}B parameters need {counts[0] if counts else 'more than 16384'} "
        "devices before activations)"
    )
