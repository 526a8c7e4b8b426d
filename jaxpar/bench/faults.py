"""`scripts/bench.py faults`: what each kind of fault costs a run, in its goodput.

One config (default configs/llama_tiny.py), `steps` steps, a persistent checkpoint every `every`
steps, trained by scripts/train.py in a child process per start, as a user runs it:
- `none`: uninterrupted (the reference);
- `sigterm`: a preemption's SIGTERM after step `at` (the run saves a final checkpoint and exits 143);
- `kill`: kill -9 after step `at` (the steps since the last checkpoint are lost);
- `kill+local`: the same kill with a local tier every `local_every` steps (checkpoint.local_dir).
Each interrupted run is started again with the same command (what `launch_local.py --max_restarts`
does, without its backoff) and finishes. From the workdir's goodput ledger (`jaxpar.train.goodput`),
per scenario: the whole run's goodput, the seconds lost, the restart gap, and what the second start
spent compiling and restoring; beside `none`'s. Runs alternate scenario by scenario, `repeats` times.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from jaxpar.train import goodput

SCENARIOS = ("none", "sigterm", "kill", "kill+local")
WAIT_S = 600


def _train(script: str, config_file: str, workdir: str, flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, script, f"--config={config_file}", f"--workdir={workdir}", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _logged(workdir: str, step: int) -> bool:
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return any(json.loads(line).get("step") == step for line in f if line.endswith("\n"))
    except (OSError, ValueError):
        return False


def _scenario(script: str, config_file: str, folder: str, name: str, steps: int, every: int, at: int, local_every: int) -> dict:
    workdir = os.path.join(folder, name.replace("+", "_"))
    flags = [f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={every}", "--overwrite"]
    if name == "kill+local":
        flags += [f"--config.checkpoint.local_dir={workdir}-local", f"--config.checkpoint.local_every_steps={local_every}"]
    process = _train(script, config_file, workdir, flags)
    if name != "none":
        deadline = time.monotonic() + WAIT_S
        while not _logged(workdir, at):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the run ended or stalled before step {at} (exit {process.poll()})")
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM if name == "sigterm" else signal.SIGKILL)
        process.wait(timeout=WAIT_S)
        process = _train(script, config_file, workdir, [f for f in flags if f != "--overwrite"])
    if process.wait(timeout=WAIT_S) != 0:
        raise RuntimeError(f"{name}: the run failed (exit {process.returncode})")
    attempts = goodput.read(workdir)
    total = goodput.totals(attempts)
    later = goodput.account(attempts[-1]) if len(attempts) > 1 else dict.fromkeys(goodput.KINDS, 0.0)
    return {"goodput": total["productive"] / total["wall"], "wall": total["wall"], "lost": total["lost"],
            "restart": total[goodput.RESTART], "compile": later["compile"], "restore": later["restore"], "starts": len(attempts)}


def bench(root: str, config_file: str, steps: int, every: int, at: int, local_every: int, repeats: int) -> list[str]:
    """The table's lines (also printed)."""
    script = os.path.join(root, "scripts", "train.py")
    runs: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    with tempfile.TemporaryDirectory(prefix="jaxpar_bench_faults_") as folder:
        for repeat in range(repeats):
            for name in SCENARIOS:
                runs[name].append(_scenario(script, config_file, folder, name, steps, every, at, local_every))
                print(f"repeat {repeat + 1}/{repeats} {name}: {runs[name][-1]}", flush=True)
    lines = [f"fault costs: {os.path.basename(config_file)}, {steps} steps, a checkpoint every {every} (local tier every "
             f"{local_every}), the fault after step {at}; medians of {repeats}",
             "| fault | starts | goodput | wall (s) | lost (s) | restart gap (s) | 2nd start: compile (s) | restore (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        lines.append(f"| {name} | {results[0]['starts']} | {100 * med['goodput']:.1f}% | {med['wall']:.1f} | {med['lost']:.2f} | "
                     f"{med['restart']:.1f} | {med['compile']:.1f} | {med['restore']:.2f} |")
    print("\n".join(lines))
    return lines
