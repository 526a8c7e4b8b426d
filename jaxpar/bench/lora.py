"""`scripts/bench.py lora`: LoRA against full fine-tuning of the same model on the same mesh: each
one's compiled per-device memory (`jaxpar.train.fit.step_memory`: parameters, optimizer state,
temporaries) and its step time.

Both programs are built and compiled first; then blocks of `steps` steps alternate between them
`repeats` times in this one process (load on the machine hits both alike) and the medians are
printed, one line per contender: `mode=<full|loraR> params_mib=.. optimizer_mib=.. temp_mib=..
total_mib=.. step_ms=.. trainable=..`, then the ratios of LoRA to full.
"""

from __future__ import annotations

import copy
import math
import statistics

import jax

from jaxpar.models import lora
from jaxpar.train import harness
from jaxpar.train.fit import step_memory

MIB = 2**20


def _trainable(program, state) -> int:
    params = jax.tree_util.tree_flatten_with_path(state.params)[0]
    adapting = lora.settings(program.model_config) is not None
    return sum(x.size for p, x in params if not adapting or lora.is_adapter(p))


def bench(config, mesh: dict, rank: int, steps: int, repeats: int, targets: str = "") -> dict:
    """Prints the comparison (module docstring); returns {mode: (memory, median step seconds)}."""
    runs, memory = {}, {}
    for mode, r in (("full", 0), (f"lora{rank}", rank)):
        c = copy.deepcopy(config)
        c.mesh.update(mesh)
        c.train.lora.rank = r
        if targets:
            c.train.lora.targets = targets
        devices = jax.devices()[: math.prod(c.mesh.values())]
        run = harness.prepare(c, devices)
        run.compile()
        memory[mode] = step_memory(run.executable, run.state, run.batch)
        run.step()  # the first step after compiling is not timed
        runs[mode] = run
    times = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            times[mode] += run.steps(steps)[1]
    result = {}
    for mode, run in runs.items():
        m, median = memory[mode], statistics.median(times[mode])
        result[mode] = (m, median)
        print(f"mode={mode} params_mib={m.parameters / MIB:.1f} optimizer_mib={m.optimizer / MIB:.1f} "
              f"temp_mib={m.temporaries / MIB:.1f} total_mib={m.needed / MIB:.1f} step_ms={median * 1e3:.1f} "
              f"trainable={_trainable(run.program, run.state):,}",
              flush=True)
    (full, full_s), (low, low_s) = result["full"], result[f"lora{rank}"]
    print(f"lora{rank}/full: total memory {low.needed / full.needed:.2f}x, optimizer state "
          f"{low.optimizer / max(full.optimizer, 1):.3f}x, temporaries {low.temporaries / full.temporaries:.2f}x, "
          f"step time {low_s / full_s:.2f}x")
    return result
