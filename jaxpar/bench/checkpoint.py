"""`scripts/bench.py checkpoint`: what a checkpoint save costs the training steps, per storage.

First the save itself, per directory, alternating, `repeats` x 3 times: the seconds `Checkpoints.save`
blocks the caller (the copy of the state to host memory; the files are written in the background) and
the seconds until the checkpoint is complete on storage (`wait`). Then the runs: the bench config
(`configs/bench_llama.py`, AdamW: params and two moments in fp32) trains `steps` steps through the
real loop (`jaxpar.train.loop.train`, asynchronous saves as runs make them) once per target: `none`
saves only at the end, each named directory every `every` steps, as a checkpoint tier there would
(`checkpoint.dir` on shared storage, `checkpoint.local_dir` on a node's disk or /dev/shm). Targets
alternate within one process, `repeats` times, so load on the machine hits them alike. Per target,
from the run's goodput ledger (`jaxpar.train.goodput`): the median step time (`step_s`: a background
write competing for the cores shows there) and the wall time per step of the steps with their saves,
beside `none`'s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile

import jax

from jaxpar.train import goodput
from jaxpar.train.loop import train

NONE = "none"


def _run(config, workdir: str, steps: int, every: int, target: str) -> dict:
    config = config.copy_and_resolve_references()
    config.train.steps, config.train.log_every = steps, 1
    config.checkpoint.every_steps, config.checkpoint.keep = (0 if target == NONE else every), 2
    config.checkpoint.dir = "" if target == NONE else os.path.join(target, "jaxpar-bench-checkpoints")
    if target != NONE:
        shutil.rmtree(config.checkpoint.dir, ignore_errors=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(config, workdir, devices=jax.devices()[:1], overwrite=True, progress=False)
    (attempt,) = goodput.read(workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        step_s = [r["step_s"] for r in map(json.loads, f) if "loss" in r][1:]  # the first step's cache warm-up left out
    saves = 0 if target == NONE else steps // every
    waited = attempt["seconds"].get("checkpoint", 0.0)
    if target != NONE:
        shutil.rmtree(config.checkpoint.dir, ignore_errors=True)
    return {"waited": waited, "saves": saves, "step_s": statistics.median(step_s),
            "per_step": (attempt["seconds"]["productive"] + waited) / steps}


def _save_times(config, targets: list[str], repeats: int) -> dict[str, tuple[float, float]]:
    """{directory: (median seconds save() blocked, median seconds until complete)}."""
    import time

    from jaxpar.checkpoint import Checkpoints
    from jaxpar.train.setup import build

    program = build(config, jax.devices()[:1])
    state = program.init()
    times: dict[str, list[tuple[float, float]]] = {t: [] for t in targets}
    managers = {t: Checkpoints(os.path.join(t, "jaxpar-bench-saves"), every_steps=1, keep=1) for t in targets}
    try:
        for step in range(1, 3 * repeats + 1):
            for target, manager in managers.items():
                started = time.perf_counter()
                manager.save(step, state, data_state={}, config=config.to_json_best_effort(), force=True)
                blocked = time.perf_counter() - started
                manager.wait()
                times[target].append((blocked, time.perf_counter() - started))
    finally:
        for target, manager in managers.items():
            manager.close()
            shutil.rmtree(os.path.join(target, "jaxpar-bench-saves"), ignore_errors=True)
    return {t: (statistics.median(b for b, _ in v), statistics.median(c for _, c in v)) for t, v in times.items()}


def bench(config, targets: list[str], steps: int, every: int, repeats: int) -> list[str]:
    """The table's lines (also printed)."""
    saves = _save_times(config, targets, repeats)
    runs: dict[str, list[dict]] = {t: [] for t in (NONE, *targets)}
    with tempfile.TemporaryDirectory(prefix="jaxpar_bench_ckpt_") as folder:
        for repeat in range(repeats):
            for target in runs:
                runs[target].append(_run(config, os.path.join(folder, f"run{repeat}"), steps, every, target))
                print(f"repeat {repeat + 1}/{repeats} {target}: {runs[target][-1]}", flush=True)
    state_mb = _state_mb(config)
    lines = [f"checkpoint save cost: {state_mb:.0f} MB of state; saves timed {3 * repeats} times per storage; runs of {steps} "
             f"steps, a save every {every}, median of {repeats}",
             "| storage | save blocks (s) | save complete (s) | saves in a run | step_s median (s) | time per step with saves (s) "
             "| vs none |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = statistics.median(r["per_step"] for r in runs[NONE])
    for target, results in runs.items():
        blocked, complete = saves.get(target, (0.0, 0.0))
        per_step = statistics.median(r["per_step"] for r in results)
        lines.append(f"| {target} | {blocked:.3f} | {complete:.3f} | {results[0]['saves']} | "
                     f"{statistics.median(r['step_s'] for r in results):.3f} | {per_step:.3f} | {per_step / base:.2f}x |")
    print("\n".join(lines))
    return lines


def _state_mb(config) -> float:
    from jaxpar.checkpoint.storage import state_bytes
    from jaxpar.train.setup import build

    program = build(config, jax.devices()[:1])
    return state_bytes(jax.eval_shape(program.init)) / 2**20
