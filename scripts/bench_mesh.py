"""jaxpar beside MaxText on MaxText's tiny Llama, 8 emulated CPU devices, the same meshes.

  python scripts/bench_mesh.py [--mesh=fsdp8,dp8,tp2dp4,pp2dp4,cp2dp4] [--remat=full,none] [--repeats=3]
      [--maxtext] [--steps=10] [--trees=PATH,PATH] [--override=parallel.sequence_parallel=True]

Every run is a fresh process (cold compile, as MaxText's runner measures it): jaxpar runs
`configs/maxtext_tiny.py` on the mesh (fsdp8 = data 8 + ZeRO-3, dp8, tp2dp4 = tensor 2 × data 4,
pp2dp4 = pipeline 2 × data 4 with 2 microbatches,
cp2dp4 = context 2 × data 4; one = the whole batch on one device, no collectives: on 8 emulated
devices sharing the same cores, a bound no mesh can beat), one fixed random batch, 10 steps; the step
time is the median of steps 4..10 (each step waited for), as MaxText's runner takes its median
after 3 warm-up steps. With --maxtext, `../shared/peers/maxtext/run_tiny.sh MESH fp32 REMAT` runs
right after each jaxpar run (interleaved, repeated), and the table shows tokens/s side by side
(median over repeats, min–max), the ratio, and each side's train-step compile time.
Layouts are matched by mesh, not by what each side shards: MaxText's rules shard the weights'
embed dimension over `fsdp` and `context` (base.yml), so its cp2dp4 is FSDP over context while
jaxpar's keeps weights and optimizer state replicated unless ZeRO is asked for
(`--override=parallel.zero_stage=1`; measured in docs/peers.md). Its data axis replicates, as
jaxpar's dp8 does.
`--trees` runs jaxpar from several source trees (e.g. a copy of the previous commit) interleaved
the same way, for before/after measurements of one change.
"""

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

_MESH = flags.DEFINE_list("mesh", ["fsdp8", "dp8", "tp2dp4", "pp2dp4"], "Meshes (MaxText runner names).")
_REMAT = flags.DEFINE_list("remat", ["full"], "Remat policies (each side's own names; `none` on both).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Interleaved repetitions of the whole matrix.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per run (the first 3 are warm-up).")
_MAXTEXT = flags.DEFINE_bool("maxtext", False, "Also run MaxText's runner, interleaved.")
_TREES = flags.DEFINE_list("trees", [], "jaxpar source trees to compare (default: this one).")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "config overrides key=value for jaxpar (Python literals).")
_WORKER = flags.DEFINE_string("worker", "", "Internal: run one jaxpar measurement (json spec).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAXTEXT_RUNNER = os.path.join(os.path.dirname(ROOT), "shared", "peers", "maxtext", "run_tiny.sh")
WARMUP = 3
# Compile events jax.monitoring reports (trace to jaxpr, lower to MLIR, XLA compile): their sum
# during the first step is the train step's compile time, as MaxText's runner measures it.
COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
DEVICES = 8


def mesh_settings(name: str) -> tuple[dict, dict]:
    """(mesh sizes, parallel overrides) for a MaxText mesh name."""
    from jaxpar.axes import CONTEXT, DATA, PIPELINE, TENSOR

    return {
        "fsdp8": ({DATA: 8}, {"zero_stage": 3}),
        "dp8": ({DATA: 8}, {}),
        "tp2dp4": ({DATA: 4, TENSOR: 2}, {}),
        "tp2fsdp4": ({DATA: 4, TENSOR: 2}, {"zero_stage": 3}),
        "pp2dp4": ({DATA: 4, PIPELINE: 2}, {"num_microbatches": 2}),
        "cp2dp4": ({DATA: 4, CONTEXT: 2}, {}),  # jaxpar's default all_gather CP, as MaxText's
        # The whole global batch on one device: no collectives and 8x larger matmuls. The 8
        # emulated devices share the same 2 cores, so this is what a mesh could reach at best.
        "one": ({}, {}),
    }[name]


def build_config(mesh: str, remat: str, overrides: list[str]):
    import ast
    import importlib.util

    from jaxpar.axes import MESH_AXES

    spec = importlib.util.spec_from_file_location("maxtext_tiny", os.path.join(ROOT, "configs", "maxtext_tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    sizes, parallel = mesh_settings(mesh)
    config.mesh.update({axis: sizes.get(axis, 1) for axis in MESH_AXES})
    config.parallel.update(parallel)
    config.parallel.remat = remat
    for item in overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        config[section][name] = value
    return config


def worker(spec: dict) -> dict:
    """One cold run in this process: compile time of the train step, median step time."""
    import jax
    import numpy as np

    from jaxpar.train import harness

    compile_s = [0.0]

    def on_duration(event, duration, **_):
        if event.rsplit("/", 1)[-1] in COMPILE_EVENTS:
            compile_s[0] += duration

    config = build_config(spec["mesh"], spec["remat"], spec["overrides"])
    config.train.steps = spec["steps"]
    devices = jax.devices()[: int(np.prod([config.mesh[axis] for axis in config.mesh]))]
    run = harness.prepare(config, devices)
    train = config.train
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    run.compile()  # the train step's compile events, after init's
    first_compile = compile_s[0]
    times, losses = [], []
    for _ in range(spec["steps"]):
        metrics, seconds = run.step()
        losses.append(float(metrics["loss"]))
        times.append(seconds)
    step_s = statistics.median(times[WARMUP:])
    return {
        "compile_train_step_s": round(first_compile, 2),
        "median_step_s": round(step_s, 4),
        "tokens_per_s": round(train.global_batch_size * train.seq_len / step_s, 1),
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
    }


def run_jaxpar(tree: str, mesh: str, remat: str) -> dict:
    spec = {"mesh": mesh, "remat": remat, "steps": _STEPS.value, "overrides": _OVERRIDE.value}
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    script = os.path.join(tree, "scripts", "bench_mesh.py")
    done = subprocess.run([sys.executable, script, f"--worker={json.dumps(spec)}"], capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}


def run_maxtext(mesh: str, remat: str) -> dict:
    if mesh == "one":
        return {"error": "MaxText's runner has no one-device mesh"}  # it would run its default mesh
    env = dict(os.environ, STEPS=str(_STEPS.value))
    done = subprocess.run(["bash", MAXTEXT_RUNNER, mesh, "fp32", remat], capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            return result if result.get("ok") else {"error": result.get("error") or result.get("log")}
    return {"error": done.stdout.strip().splitlines()[-1:]}


def summarize(results: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in results if key in r and r[key] is not None]
    if not values:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(values), min(values), max(values)


def main(argv):
    del argv
    if _WORKER.value:
        print("RESULT " + json.dumps(worker(json.loads(_WORKER.value))), flush=True)
        return
    trees = _TREES.value or [ROOT]
    sides = [(f"jaxpar[{os.path.basename(t.rstrip('/'))}]" if len(trees) > 1 else "jaxpar", t) for t in trees]
    if _MAXTEXT.value:
        sides.append(("maxtext", None))
    runs = {}
    for repeat in range(_REPEATS.value):
        for mesh in _MESH.value:
            for remat in _REMAT.value:
                for label, tree in sides:
                    result = run_jaxpar(tree, mesh, remat) if tree else run_maxtext(mesh, remat)
                    runs.setdefault((mesh, remat, label), []).append(result)
                    print(f"[{repeat + 1}] {mesh} remat={remat} {label}: {json.dumps(result)}", flush=True)
    print(f"\nload average at the end: {os.getloadavg()}")
    first = sides[0][0]
    header = "| mesh | remat | side | tokens/s median (min–max) | " + first + " ÷ this | compile train step s |"
    print("\n" + header + "\n|---|---|---|---|---|---|")
    for mesh in _MESH.value:
        for remat in _REMAT.value:
            base = summarize(runs[(mesh, remat, first)], "tokens_per_s")[0]
            for label, _ in sides:
                results = runs[(mesh, remat, label)]
                med, lo, hi = summarize(results, "tokens_per_s")
                comp = summarize(results, "compile_train_step_s")[0]
                errors = [r["error"] for r in results if r.get("error")]
                note = f" errors: {errors[0]}" if errors else ""
                print(f"| {mesh} | {remat} | {label} | {med:.0f} ({lo:.0f}–{hi:.0f}) | {base / med:.2f}× | {comp:.2f} |{note}")


if __name__ == "__main__":
    app.run(main)
