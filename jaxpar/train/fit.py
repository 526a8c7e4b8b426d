"""Will the step fit? The compiled program's memory per device against what a device holds, before anything is allocated.

`compile_fitting(program, config, devices)` compiles the train step ahead of time on abstract inputs
(`abstract_inputs`: the state as `jax.eval_shape(program.init)` with the program's shardings and a
ShapeDtypeStruct batch — nothing is allocated and no data is read) and compares XLA's own account of
the step (`compiled.memory_analysis()`: arguments + outputs + temporaries - outputs aliased to donated
arguments, per device) with what one device can hold (`available_per_device`):

  GPU / TPU  the allocator's limit less what is in use (`device.memory_stats()`; JAX's default limit is
             75% of HBM, `XLA_PYTHON_CLIENT_MEM_FRACTION` raises it);
  CPU        the host's available memory (MemAvailable) shared by this process's emulated devices.

A device that reports no allocator limit (`memory_stats()` None, or without "bytes_limit": some
plugins and device kinds) cannot be checked: `compile_fitting` says so in one line (the device kind
and what the step needs per device) and goes on; it never skips the check silently.

If it does not fit it raises `DoesNotFit` (a `ConfigError`: scripts/train.py exits 2), one line: needed
against available per device and the term that dominates (parameters, optimizer state, temporaries —
activations, gradients and work buffers —, outputs). scripts/train.py adds the planner's best layout
for these devices (`jaxpar.analysis.planner.fit_advice`; the planner is not imported here, `jaxpar.analysis`
imports this package). `train.skip_fit_check=True` compiles without comparing.

The compiled executable is what the loop then runs: the abstract state carries the shardings the real
state is created and restored with, so no second compile happens.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.data.corpus import batch_channels
from jaxpar.train.preflight import ConfigError

GIB = 2**30


class DoesNotFit(ConfigError):
    """The compiled step needs more memory per device than a device holds (one line). `needed` and
    `available` are bytes per device; `dominant` names the largest term."""

    def __init__(self, message: str, needed: int, available: int, dominant: str):
        super().__init__(message)
        self.needed, self.available, self.dominant = needed, available, dominant


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled step, split into the terms the error names."""

    parameters: int
    optimizer: int  # optimizer state and the other state leaves (step, loss scale)
    batch: int
    temporaries: int  # activations, gradients, work buffers
    outputs: int  # outputs not written into donated arguments (the metrics)

    @property
    def needed(self) -> int:
        return self.parameters + self.optimizer + self.batch + self.temporaries + self.outputs

    def terms(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("optimizer state", self.optimizer),
            ("temporaries (activations, gradients, work buffers)", self.temporaries),
            ("the batch", self.batch),
            ("outputs", self.outputs),
        ]

    @property
    def dominant(self) -> tuple[str, int]:
        return max(self.terms(), key=lambda kv: kv[1])


def abstract_inputs(program, config):
    """(state, batch) as ShapeDtypeStructs carrying the program's shardings; nothing allocated."""
    state = jax.eval_shape(program.init)
    state = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), state, program.state_shardings
    )
    # Tokens and segment ids of each row, and a loss mask for chat data (`jaxpar.data.DocumentBatches`).
    rows, width = config.train.global_batch_size, config.train.seq_len + 1
    batch = jax.ShapeDtypeStruct((rows, batch_channels(config), width), jnp.int32, sharding=program.batch_sharding)
    return state, batch


def _bytes_per_device(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * jnp.dtype(leaf.dtype).itemsize
    return total


def step_memory(compiled, state, batch) -> StepMemory:
    """`compiled.memory_analysis()` split into terms: the arguments by what they hold (the state's
    shards under its shardings), the temporaries and the outputs not aliased to donated arguments."""
    stats = compiled.memory_analysis()
    params = _bytes_per_device(state.params)
    batch_bytes = _bytes_per_device(batch)
    # The rest of the arguments: optimizer state, step, loss scale (XLA's total is the reference).
    rest = max(0, int(stats.argument_size_in_bytes) - params - batch_bytes)
    outputs = max(0, int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes))
    return StepMemory(params, rest, batch_bytes, int(stats.temp_size_in_bytes), outputs)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_per_device(devices) -> tuple[int | None, str]:
    """(bytes one device can still allocate, where the number comes from); None when unknown."""
    device = devices[0]
    if device.platform == "cpu":
        local = max(1, len([d for d in devices if d.process_index == jax.process_index()]))
        return host_available_bytes() // local, f"host memory available / {local} cpu devices"
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None, f"{device.device_kind} ({device.platform}) reports no memory limit"
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free, f"{device.device_kind} allocator limit less bytes in use"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def check(memory: StepMemory, available: int, devices, source: str) -> None:
    """Raises `DoesNotFit` when the step needs more than `available` bytes per device."""
    if memory.needed <= available:
        return
    name, size = memory.dominant
    where = f"{len(devices)} {devices[0].platform} devices"
    raise DoesNotFit(
        f"the step does not fit {where}: it needs {_gib(memory.needed)} per device, {_gib(available)} available "
        f"({source}); the largest term is {name}, {_gib(size)} ({100 * size / memory.needed:.0f}%); "
        "set train.skip_fit_check=True to run anyway",
        memory.needed, available, name,
    )


def _everyone_fits(fits: bool) -> bool:
    if jax.process_count() == 1:
        return fits
    flags = multihost_utils.process_allgather(np.asarray([fits], np.int32), tiled=True)
    return bool(np.all(np.asarray(flags)))


def unchecked_notice(memory: StepMemory, source: str) -> str:
    """The line said when the devices report no limit to compare with."""
    return (f"warning: the fit check could not run: {source} (device.memory_stats() has no bytes_limit); "
            f"the step needs {_gib(memory.needed)} per device and was not compared with anything")


def _warn(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def compile_fitting(program, config, devices, say=_warn):
    """(the compiled step, compile seconds) after the fit check (module doc); raises DoesNotFit.
    `say(line)`: where the one-line notice goes when the devices report no memory limit."""
    started = time.perf_counter()
    state, batch = abstract_inputs(program, config)
    compiled = program.step.lower(state, batch).compile()
    seconds = time.perf_counter() - started
    if config.train.skip_fit_check:
        return compiled, seconds
    available, source = available_per_device(list(devices))
    memory = step_memory(compiled, state, batch)
    if available is None:  # the same on every process (one device kind): no collective to agree on
        say(unchecked_notice(memory, source))
        return compiled, seconds
    error = None
    try:
        check(memory, available, list(devices), source)
    except DoesNotFit as e:
        error = e
    if not _everyone_fits(error is None):  # every process stops, not only the one that is short
        raise error or DoesNotFit(
            "the step does not fit the devices of another process (see its error)", memory.needed, available, "-"
        )
    return compiled, seconds
