"""`scripts/bench.py checkpoint`: what a checkpoint save costs the training steps, per storage.

The bench config (`configs/bench_llama.py`, AdamW: params and two moments in fp32) trains `steps`
steps through the real loop (`jaxpar.train.loop.train`, asynchronous saves as runs make them) once
per target: `none` saves only at the end, each named directory every `every` steps, as a
checkpoint tier there would (`checkpoint.dir` on shared storage, `checkpoint.local_dir` on a node's
disk or /dev/shm). Targets alternate within one process, `repeats` times, so load on the machine hits
them alike. Per target, from the run's goodput ledger (`jaxpar.train.goodput`): the seconds the loop
waited per save (the copy to host and the blocking part of Orbax's save), the median step time
(`step_s`: the steps themselves; a background write competing for the cores shows there), and the
wall time per step of the steps with their saves, beside `none`'s.
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


def bench(config, targets: list[str], steps: int, every: int, repeats: int) -> list[str]:
    """The table's lines (also printed)."""
    runs: dict[str, list[dict]] = {t: [] for t in (NONE, *targets)}
    with tempfile.TemporaryDirectory(prefix="jaxpar_bench_ckpt_") as folder:
        for repeat in range(repeats):
            for target in runs:
                runs[target].append(_run(config, os.path.join(folder, f"run{repeat}"), steps, every, target))
                print(f"repeat {repeat + 1}/{repeats} {target}: {runs[target][-1]}", flush=True)
    state_mb = _state_mb(config)
    lines = [f"checkpoint save cost: {steps} steps, a save every {every} ({state_mb:.0f} MB of state), median of {repeats}",
             "| storage | saves | waited per save (s) | step_s median (s) | time per step with saves (s) | vs none |",
             "| --- | --- | --- | --- | --- | --- |"]
    base = statistics.median(r["per_step"] for r in runs[NONE])
    final = statistics.median(r["waited"] for r in runs[NONE])  # every run waits for its final save
    for target, results in runs.items():
        saves = results[0]["saves"]
        waited = max(0.0, statistics.median(r["waited"] for r in results) - final) / saves if saves else 0.0
        per_step = statistics.median(r["per_step"] for r in results)
        lines.append(f"| {target} | {saves} | {waited:.3f} | {statistics.median(r['step_s'] for r in results):.3f} | "
                     f"{per_step:.3f} | {per_step / base:.2f}x |")
    print("\n".join(lines))
    return lines


def _state_mb(config) -> float:
    from jaxpar.checkpoint.storage import state_bytes
    from jaxpar.train.setup import build

    program = build(config, jax.devices()[:1])
    return state_bytes(jax.eval_shape(program.init)) / 2**20
