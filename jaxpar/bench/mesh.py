"""`scripts/bench.py mesh`: jaxpar beside MaxText on MaxText's tiny Llama (`configs/maxtext_tiny.py`),
8 emulated CPU devices, the same meshes by name.

Every run is a fresh process (a cold compile, as MaxText's runner measures it): jaxpar runs the config
on the mesh (fsdp8 = data 8 + ZeRO-3, dp8, tp2dp4 = tensor 2 x data 4, tp2fsdp4 = the same with ZeRO-3,
pp2dp4 = pipeline 2 x data 4 with 2 microbatches, cp2dp4 = context 2 x data 4; one = the whole batch on
one device, no collectives: on 8 emulated devices sharing the same cores, a bound no mesh can beat),
one fixed random batch, `steps` steps; the step time is the median after WARMUP steps (each waited
for), as MaxText's runner takes its median. The train step's compile time is the sum of the compile
events jax.monitoring reports while it compiles (trace to jaxpr, lower to MLIR, XLA compile).
MaxText runs through `benchmarks/peers/maxtext/run_tiny.py` in its own environment, with the model
keys derived here from the same jaxpar config (`maxtext_overrides`), so the two cannot drift apart.

Layouts are matched by mesh, not by what each side shards: MaxText's rules shard the weights' embed
dimension over `fsdp` and `context`, so its cp2dp4 is FSDP over context while jaxpar's keeps weights
and optimizer state replicated unless ZeRO is asked for (`--override=parallel.zero_stage=1`). Its data
axis replicates, as jaxpar's dp8 does.
"""

from __future__ import annotations

import ast
import json
import math
import os
import statistics
import subprocess
import sys

from jaxpar.axes import CONTEXT, DATA, MESH_AXES, PIPELINE, TENSOR

WARMUP = 3
DEVICES = 8
# Compile events jax.monitoring reports: their sum while the train step compiles is its compile time.
COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
# MaxText's mesh names -> (jaxpar mesh sizes, parallel keys).
MESHES = {
    "fsdp8": ({DATA: 8}, {"zero_stage": 3}),
    "dp8": ({DATA: 8}, {}),
    "tp2dp4": ({DATA: 4, TENSOR: 2}, {}),
    "tp2fsdp4": ({DATA: 4, TENSOR: 2}, {"zero_stage": 3}),
    "pp2dp4": ({DATA: 4, PIPELINE: 2}, {"num_microbatches": 2}),
    "cp2dp4": ({DATA: 4, CONTEXT: 2}, {}),  # jaxpar's default all_gather context parallelism, as MaxText's
    # The whole global batch on one device: no collectives and 8x larger matmuls. The 8 emulated devices
    # share the same cores, so this is what a mesh could reach at best.
    "one": ({}, {}),
}


def override_problems(overrides: list[str]) -> list[str]:
    """One line per `--override` that is not SECTION.KEY=VALUE."""
    return [f"--override={item}: give SECTION.KEY=VALUE, e.g. parallel.zero_stage=1"
            for item in overrides if "=" not in item or "." not in item.split("=", 1)[0]]


def build_config(base, mesh: str, remat: str, overrides: list[str]):
    """A copy of `base` on the named mesh with the remat policy and `SECTION.KEY=VALUE` overrides
    (values read as Python literals where they are one)."""
    config = base.copy_and_resolve_references()
    sizes, parallel = MESHES[mesh]
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


def maxtext_overrides(config, devices: int = DEVICES) -> dict[str, str]:
    """MaxText's keys for the model and batch of a jaxpar Llama config (its base.yml names)."""
    model, train = config.model, config.train
    return {
        "base_emb_dim": str(model.hidden_size),
        "base_num_query_heads": str(model.num_attention_heads),
        "base_num_kv_heads": str(model.num_key_value_heads),
        "head_dim": str(model.head_dim),
        "base_mlp_dim": str(model.intermediate_size),
        "base_num_decoder_layers": str(model.num_hidden_layers),
        "vocab_size": str(model.vocab_size),
        "max_target_length": str(train.seq_len),
        "per_device_batch_size": str(train.global_batch_size // devices),
        "learning_rate": str(train.learning_rate),
    }


def worker(base, spec: dict) -> dict:
    """One cold run in this process: the train step's compile time, the median step time, losses."""
    import jax
    import numpy as np

    from jaxpar.train import harness

    compile_s = [0.0]

    def on_duration(event, duration, **_):
        if event.rsplit("/", 1)[-1] in COMPILE_EVENTS:
            compile_s[0] += duration

    config = build_config(base, spec["mesh"], spec["remat"], spec["overrides"])
    config.train.steps = spec["steps"]
    devices = jax.devices()[: int(np.prod([config.mesh[axis] for axis in config.mesh]))]
    run = harness.prepare(config, devices)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    run.compile()  # the train step's compile events, after init's
    first_compile = compile_s[0]
    times, losses = [], []
    for _ in range(spec["steps"]):
        metrics, seconds = run.step()
        losses.append(float(metrics["loss"]))
        times.append(seconds)
    step_s = statistics.median(times[WARMUP:] or times)
    return {
        "compile_train_step_s": round(first_compile, 2),
        "median_step_s": round(step_s, 4),
        "tokens_per_s": round(config.train.global_batch_size * config.train.seq_len / step_s, 1),
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
    }


def _result(stdout: str, stderr: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": ((stderr or stdout).strip().splitlines() or ["no output"])[-1]}


def run_jaxpar(tree: str, spec: dict) -> dict:
    """`spec` measured by `scripts/bench.py mesh --worker` of the source tree `tree`, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    script = os.path.join(tree, "scripts", "bench.py")
    done = subprocess.run([sys.executable, script, "mesh", f"--worker={json.dumps(spec)}"], capture_output=True, text=True, env=env)
    return _result(done.stdout, done.stderr)


def run_maxtext(python: str, runner: str, mesh: str, remat: str, steps: int, model: dict[str, str]) -> dict:
    """One MaxText run of `runner` (benchmarks/peers/maxtext/run_tiny.py) under `python`, its environment's."""
    if mesh == "one":
        return {"error": "MaxText's runner has no one-device mesh"}
    if not os.path.exists(python):
        return {"error": f"{python} not found: install the MaxText peer (benchmarks/peers/maxtext/README.md)"}
    command = [python, runner, f"--mesh={mesh}", "--dtype=fp32", f"--remat={remat}", f"--steps={steps}",
               *(f"{key}={value}" for key, value in model.items())]
    done = subprocess.run(command, capture_output=True, text=True)
    result = _result(done.stdout, done.stderr)
    return result if result.get("ok", "error" not in result) else {"error": result.get("error") or result.get("log")}


def summarize(results: list[dict], key: str) -> tuple[float, float, float]:
    """(median, min, max) of `key` over the runs that have it."""
    values = [r[key] for r in results if r.get(key) is not None]
    if not values:
        return math.nan, math.nan, math.nan
    return statistics.median(values), min(values), max(values)


def table(runs: dict, meshes: list[str], remats: list[str], sides: list[str]) -> list[str]:
    """The markdown table: tokens/s per side (median, min-max), the first side over each, compile s."""
    first = sides[0]
    lines = [f"| mesh | remat | side | tokens/s median (min–max) | {first} ÷ this | compile train step s |",
             "|---|---|---|---|---|---|"]
    for mesh in meshes:
        for remat in remats:
            base = summarize(runs[(mesh, remat, first)], "tokens_per_s")[0]
            for label in sides:
                results = runs[(mesh, remat, label)]
                med, lo, hi = summarize(results, "tokens_per_s")
                comp = summarize(results, "compile_train_step_s")[0]
                errors = [r["error"] for r in results if r.get("error")]
                note = f" errors: {errors[0]}" if errors else ""
                lines.append(f"| {mesh} | {remat} | {label} | {med:.0f} ({lo:.0f}–{hi:.0f}) | {base / med:.2f}× | {comp:.2f} |{note}")
    return lines


def matrix(meshes: list[str], remats: list[str], repeats: int, sides: dict) -> dict:
    """{(mesh, remat, side): [result per repeat]}: every side (label -> (mesh, remat) -> result) run
    on every mesh and remat policy, interleaved, the whole matrix `repeats` times; a line per run."""
    runs = {}
    for repeat in range(repeats):
        for mesh in meshes:
            for remat in remats:
                for label, measure in sides.items():
                    result = measure(mesh, remat)
                    runs.setdefault((mesh, remat, label), []).append(result)
                    print(f"[{repeat + 1}] {mesh} remat={remat} {label}: {json.dumps(result)}", flush=True)
    return runs
