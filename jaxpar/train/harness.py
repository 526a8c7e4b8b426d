"""The train step as the measuring scripts run it: checked, built, on one random batch, compiled, timed.

`scripts/bench.py` and `scripts/pipeline.py` (their bodies in `jaxpar.bench`) time jaxpar's real train
step outside the training loop (no data, no checkpoints, no workdir); this module is the sequence they
share:

    run = harness.prepare(config, devices)  # preflight.check, build, init (waited for), the batch
    seconds = run.compile()                 # ahead of time, as the training loop compiles
    metrics, seconds = run.step()           # one step, waited for; run.state advances
    metrics, times = run.steps(5)           # several, each waited for and timed alone
    out, wall, cpu = harness.timed(fn)      # anything else (a decode, a block of steps), waited for

`prepare` checks the config first (`jaxpar.train.preflight.check`: bad input raises `ConfigError`, one line
per problem naming the key, before anything compiles). The batch is one fixed array of uniform
random token ids from numpy seed `seed`, the same for every layout of a config, so losses compare
across runs. `step` compiles on first use if `compile` was not called; callers that measure the
compile itself (its wall time, or jax.monitoring's compile events) call `compile` explicitly.
`timed` also reports this process's CPU seconds (all its threads): on a machine shared with other
jobs they swing less than wall time, which their load stretches.

Compiling on abstract inputs instead (nothing allocated, e.g. for memory and collectives of a
config too large to run) is `jaxpar.analysis.program.compiled.compile_step(config, devices, checked=True)`,
which builds with `checked_build` from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpar.train import preflight
from jaxpar.train.setup import TrainProgram, build


def checked_build(config, devices=None) -> TrainProgram:
    """`build(config, devices)` after `preflight.check` for that many devices (default: all)."""
    preflight.check(config, len(jax.devices() if devices is None else devices))
    return build(config, devices)


def timed(fn, *args):
    """(fn(*args) waited for, its wall seconds, this process's CPU seconds over the same span)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - wall, time.process_time() - cpu


def rotating(runs: dict, steps: int, repeats: int, line) -> tuple[dict, dict]:
    """Side-by-side timing on a noisy machine: `repeats` rounds, each running `steps` steps of every
    run in turn, so load changes hit every run alike. `runs`: {key: a Harness}; `line(wall)` is
    printed after each round. Returns ({key: wall seconds per step}, {key: CPU seconds per step})."""
    wall, cpu = ({key: [] for key in runs} for _ in range(2))
    for repeat in range(repeats):
        for key, run in runs.items():
            for _ in range(steps):
                (_, seconds), _, cpu_s = timed(run.step)
                wall[key].append(seconds)
                cpu[key].append(cpu_s)
        print(f"[{repeat + 1}] {line(wall)}", flush=True)
    return wall, cpu


def random_batch(config, program: TrainProgram, seed: int = 0) -> jax.Array:
    """One global batch of token ids, [global_batch_size, seq_len + 1] int32 uniform in
    [0, vocab_size), placed on the program's batch sharding."""
    shape = (config.train.global_batch_size, config.train.seq_len + 1)
    tokens = np.random.default_rng(seed).integers(0, config.model.vocab_size, shape).astype(np.int32)
    return jax.device_put(tokens, program.batch_sharding)


@dataclass
class Harness:
    """A built train step with its state and batch (see the module docstring)."""

    program: TrainProgram
    state: Any  # the TrainState; every step donates it and stores the next one here
    batch: jax.Array
    executable: Any = None  # the ahead-of-time compiled step, once compiled
    compile_s: float = 0.0  # wall time of lower + compile

    def compile(self):
        """Compiles the step for this state and batch ahead of time; returns the seconds taken."""
        start = time.perf_counter()
        self.executable = self.program.step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - start
        return self.compile_s

    def step(self) -> tuple[dict, float]:
        """One train step, waited for: (its metrics, its wall seconds, execution only)."""
        if self.executable is None:
            self.compile()
        start = time.perf_counter()
        self.state, metrics = self.executable(self.state, self.batch)
        jax.block_until_ready(metrics)
        return metrics, time.perf_counter() - start

    def steps(self, count: int) -> tuple[dict | None, list[float]]:
        """`count` steps: (the last one's metrics, each one's wall seconds)."""
        metrics, times = None, []
        for _ in range(count):
            metrics, seconds = self.step()
            times.append(seconds)
        return metrics, times


def prepare(config, devices=None, seed: int = 0) -> Harness:
    """The checked, built program with its initial state (waited for) and the random batch."""
    program = checked_build(config, devices)
    state = jax.block_until_ready(program.init())
    return Harness(program, state, random_batch(config, program, seed))
