"""Seeing inside a training run: honest step timing, MFU, TensorBoard scalars, on-demand profiles.

`Observer(config, workdir, program)` is what the training loop calls around each step:
  - `with observer.step(step):` — between steps `train.profile_start` …
    `profile_start + profile_steps - 1` (1-based, as in metrics.jsonl) records a `jax.profiler`
    trace under `WORKDIR/profile`, each step annotated,
    with the step's compiled HLO text in `WORKDIR/profile/hlo/` so that
    `scripts/profile_report.py` can attribute device time to named scopes
    (`jaxpar.analysis.program.profile`, which reads `HLO_DIR` and `STEP_ANNOTATION` from here);
  - `observer.throughput(step, seconds)` — `step_s` (execution only: the loop compiles ahead of
    time), `tokens_per_sec`, `mfu` (model FLOPs `ModelFacts.model_flops_per_step` / step time / peak FLOP/s of the
    devices), on the first step run `compile_s`, the ahead-of-time compile, and with
    `train.predicted_step_s` (set by `scripts/train.py --plan`) the planner's prediction beside them;
  - `observer.log(record)` — every numeric field of the metrics record to the trackers `train.loggers`
    names (`jaxpar.trackers`: TensorBoard scalars under `WORKDIR/tensorboard` by default, W&B,
    MLflow; list-valued MoE router statistics one scalar per expert).

Peak FLOP/s (`peak_flops_per_device`): `train.peak_flops_per_device` if set, else a table of
published dense peaks per accelerator kind and compute dtype, else (CPU) a matmul measured once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import jax
import jax.numpy as jnp

from jaxpar import trackers
from jaxpar.models.families import facts

# What a profile holds besides the trace: each step is annotated `STEP_ANNOTATION`
# (`jax.profiler.StepTraceAnnotation`), and the step's HLO text sits in `HLO_DIR` under the profile folder.
STEP_ANNOTATION = "train"
HLO_DIR = "hlo"

# Dense peak FLOP/s per chip by device kind (substring of `device.device_kind`, first match wins)
# for 16-bit and 32-bit compute. fp32 on NVIDIA counts TF32 tensor cores, which XLA uses for fp32
# matmuls at default precision. Vendor data sheets, without sparsity.
PEAK_FLOPS = (
    ("H200", {"16": 989e12, "32": 495e12}),
    ("H100", {"16": 989e12, "32": 495e12}),
    ("A100", {"16": 312e12, "32": 156e12}),
    ("L4", {"16": 121e12, "32": 60e12}),
    ("TPU v6", {"16": 918e12, "32": 918e12}),
    ("TPU v5p", {"16": 459e12, "32": 459e12}),
    ("TPU v5", {"16": 197e12, "32": 197e12}),  # v5e reports "TPU v5 lite"
    ("TPU v4", {"16": 275e12, "32": 275e12}),
)


# 1024: within the noise of 2048's rate on the 2-core host (66-69 vs 54-87 GFLOP/s, loaded), in 0.3 s
# instead of 1.5-2 s, which every CPU run's start paid.
@functools.lru_cache(maxsize=4)
def measured_host_flops(dtype_name: str = "float32", size: int = 1024) -> float:
    """FLOP/s of one `size`³ matmul on the first CPU device (best of 5): what the host's cores
    reach together. Measured once per process."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), dtype_name), device)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def measures_peak(device, override: float = 0.0) -> bool:
    """Whether `peak_flops_per_device` times a matmul for this device (seconds, once per process)."""
    return override <= 0 and device.platform == "cpu" and not any(kind in device.device_kind for kind, _ in PEAK_FLOPS)


def peak_flops_per_device(device, compute_dtype: str, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    if override > 0:
        return override, "train.peak_flops_per_device"
    bits = "16" if compute_dtype in ("bfloat16", "float16") else "32"
    for kind, peaks in PEAK_FLOPS:
        if kind in device.device_kind:
            return peaks[bits], f"table ({kind}, {bits}-bit)"
    if device.platform == "cpu":
        # Emulated CPU devices share the host's cores: each gets an equal part of the host's rate.
        local_cpus = max(1, len([d for d in jax.local_devices() if d.platform == "cpu"]))
        return measured_host_flops(compute_dtype) / local_cpus, f"measured matmul / {local_cpus} cpu devices"
    return 0.0, f"unknown device kind {device.device_kind!r}: set train.peak_flops_per_device"


def checks(config) -> list[str]:
    """Bad observability settings, one line each naming the key."""
    train, errors = config.train, trackers.checks(config.train)
    if train.profile_steps < 0:
        errors.append(f"train.profile_steps={train.profile_steps} must be >= 0 (0: no profile)")
    if train.profile_steps > 0 and train.profile_start < 1:
        errors.append(f"train.profile_start={train.profile_start} must be >= 1 (the first step is 1)")
    if train.peak_flops_per_device < 0:
        errors.append(f"train.peak_flops_per_device={train.peak_flops_per_device} must be >= 0 (0: table or measured)")
    if train.predicted_step_s < 0:
        errors.append(f"train.predicted_step_s={train.predicted_step_s} must be >= 0 (0: no prediction)")
    return errors


def save_step_hlo(profile_dir: str, compiled) -> None:
    """The compiled train step's HLO text (op names → source scopes) beside the trace, so that
    `scripts/profile_report.py` can attribute device time to named scopes."""
    os.makedirs(os.path.join(profile_dir, HLO_DIR), exist_ok=True)
    with open(os.path.join(profile_dir, HLO_DIR, "train_step.txt"), "w") as f:
        f.write(compiled.as_text())


# Fields of a metrics record that measure time, not training (they differ between equal runs).
TIMING_FIELDS = ("step_s", "tokens_per_sec", "mfu", "compile_s")


class Observer:
    """Per-step timing, MFU, the trackers' metrics and the profile window of one training run.

    The loop compiles the step ahead of time (`compiled`, taking `compile_s` seconds), so every
    step's wall time is execution only; the compile time is reported once, in the first record."""

    def __init__(self, config, workdir: str, program, compiled, compile_s: float):
        train = config.train
        self.compiled = compiled
        self.devices = list(program.mesh.devices.flat)
        self.tokens_per_step = train.global_batch_size * train.seq_len
        self.flops_per_step = facts(config.model).model_flops_per_step(train.global_batch_size, train.seq_len)
        peak, self.peak_source = peak_flops_per_device(self.devices[0], train.compute_dtype, train.peak_flops_per_device)
        self.peak_flops = peak * len(self.devices)
        self.profile_dir = os.path.join(workdir, "profile")
        self.profile_first = train.profile_start if train.profile_steps > 0 else 0
        self.profile_last = train.profile_start + train.profile_steps - 1
        self._profiling = False
        self._compile_s = compile_s  # reported with the first step, then 0
        self.predicted_step_s = float(train.predicted_step_s)
        self.trackers = trackers.Sessions(config, workdir) if jax.process_index() == 0 else None

    @contextlib.contextmanager
    def step(self, step: int):
        """Around the execution of step `step` (1-based, as in metrics.jsonl)."""
        if step == self.profile_first or (self.profile_first and self.profile_first < step <= self.profile_last and not self._profiling):
            os.makedirs(self.profile_dir, exist_ok=True)
            jax.profiler.start_trace(self.profile_dir)
            self._profiling = True
        annotation = jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=step) if self._profiling else None
        with annotation or contextlib.nullcontext():
            yield
        if self._profiling and step >= self.profile_last:
            self._stop_profile()

    def _stop_profile(self):
        jax.profiler.stop_trace()
        self._profiling = False
        save_step_hlo(self.profile_dir, self.compiled)

    def throughput(self, step: int, seconds: float) -> dict:
        """Timing fields of step `step`, which ran in `seconds` of wall time."""
        step_s = max(seconds, 1e-9)
        record = {"step_s": step_s, "tokens_per_sec": self.tokens_per_step / step_s}
        if self.peak_flops > 0:
            record["mfu"] = self.flops_per_step / step_s / self.peak_flops
        if self._compile_s:
            record["compile_s"], self._compile_s = self._compile_s, 0.0
        if self.predicted_step_s > 0:  # the planner's prediction (`--plan`), beside the measurement
            record["predicted_step_s"] = self.predicted_step_s
        return record

    def log(self, record: dict):
        """Every numeric field of `record` (with its `step`) to the trackers."""
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self, ended: str = "done"):
        """`ended`: "done", or the name of the error that ended the run (trackers mark the run so)."""
        if self._profiling:  # the run ended inside the window: keep what was traced
            self._stop_profile()
        if self.trackers is not None:
            self.trackers.close(ended)
            self.trackers = None
