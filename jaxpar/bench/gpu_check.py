"""`scripts/gpu_check.py`: what a GPU's few minutes should measure, in one run, written to one JSON and
one markdown table.

The model is Llama 3.1 8B's shape (widths, heads, vocabulary) cut to `layers` layers so that it and
its AdamW state fit one device (`--size=8b`; `--size=tiny` is the suite's CPU path). Sections, in
this order, each skipped with a note once the time budget is spent:

1. `step`: the train step in bf16 and in every FP8 recipe the config offers (`train.fp8`, when that
   key exists): median step time after one warm-up step, tokens/s, and MFU against the device's
   dense bf16 peak (FP8 runs are reported against the same peak, as torchtitan reports them);
2. `memory`: right after the first (bf16) run, the device's measured peak (`memory_stats()`'s
   `peak_bytes_in_use`) beside the fit check's prediction (the compiled step's memory analysis,
   `jaxpar.train.fit.step_memory`) and the planner's (`jaxpar.analysis.cost`);
3. `planner`: the cost model's step time for this device's profile beside the measured one;
4. `attention`: each attention implementation (XLA, jaxpar_xla, and cuDNN on a GPU) on packed
   documents, and XLA's masked sliding window beside cuDNN's `local_window_size`: the largest
   difference from XLA's result in fp32 and the forward + backward time.

On a CPU, peaks, measured memory and cuDNN are reported as not available, never guessed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models import facts
from jaxpar.models import layers as model_layers
from jaxpar.models.attention_pattern import Pattern, attend
from jaxpar.train import fit, harness

# Llama 3.1 8B's widths (configs/llama3_8b.py) with fewer layers; the tiny size is the suite's.
SIZES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, num_hidden_layers=4, seq_len=4096, global_batch_size=1),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=2, seq_len=64, global_batch_size=2),
}
NOT_ON_CPU = "n/a on cpu"


@dataclass
class Budget:
    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


def model_config(size: str, layers: int | None = None, seq: int | None = None):
    """The base config of `size`: a Llama of that shape, bf16 compute, one device."""
    from jaxpar.config import base_config
    from jaxpar.models import llama

    shape = dict(SIZES[size])
    seq_len, batch = shape.pop("seq_len"), shape.pop("global_batch_size")
    if layers:
        shape["num_hidden_layers"] = layers
    c = base_config()
    c.model = llama.model_config(**shape, rope_theta=500000.0, tie_word_embeddings=False)
    c.train.update(global_batch_size=batch, seq_len=seq or seq_len, grad_accum=1, compute_dtype="bfloat16",
                   param_dtype="float32")
    return c


def fp8_recipes(config) -> list[str]:
    """The FP8 recipes the config schema offers (none when it has no `train.fp8`)."""
    if "fp8" not in config.train:
        return []
    from jaxpar import fp8

    return [name for name in fp8.RECIPE_NAMES if name != "none"]


def hardware_profile(device):
    """The planner's profile of this device with the memory its allocator allows (on a CPU the
    planner's nominal one: 100 GFLOP/s, the host's memory)."""
    from jaxpar.analysis.planner.fit_advice import profile_for
    from jaxpar.train.fit import host_available_bytes

    stats = device.memory_stats() or {}
    return profile_for([device], int(stats.get("bytes_limit", 0)) or host_available_bytes())


def time_step(config, steps: int) -> dict:
    """Compile, one warm-up step, then `steps` timed steps of `config` on one device."""
    device = jax.devices()[:1]
    run = harness.prepare(config, device)
    compile_s = run.compile()
    run.step()
    metrics, times = run.steps(steps)
    batch, seq = config.train.global_batch_size, config.train.seq_len
    step_s = statistics.median(times)
    return {
        "compile_s": compile_s, "step_s": step_s, "tokens_per_s": batch * seq / step_s,
        "model_flops": facts(config.model).model_flops_per_step(batch, seq), "loss": float(metrics["loss"]),
        "predicted_bytes": fit.step_memory(run.executable, run.state, run.batch).needed,
    }


def step_rows(config, recipes: list[str], steps: int, budget: Budget, peak: float | None) -> list[dict]:
    rows = []
    for recipe in ["bf16", *recipes]:
        if budget.left() <= 0:
            rows.append({"precision": recipe, "skipped": "time budget spent"})
            continue
        c = config.copy_and_resolve_references()
        if recipe != "bf16":
            c.train.fp8 = recipe
        row = {"precision": recipe, **time_step(c, steps)}
        row["mfu"] = row["model_flops"] / row["step_s"] / peak if peak else None
        if recipe == "bf16":
            stats = jax.devices()[0].memory_stats() or {}
            row["measured_peak_bytes"] = stats.get("peak_bytes_in_use")
        rows.append(row)
    return rows


def planner_row(config, device, measured: dict) -> dict:
    """The cost model's step time and memory on this device's profile beside what was measured."""
    from jaxpar.analysis.cost import cost_model

    profile = hardware_profile(device)
    estimate = cost_model.estimate(config, profile, num_devices=1)
    return {
        "hardware": profile.name if device.platform != "cpu" else "cpu (the planner's nominal 100 GFLOP/s)",
        "predicted_step_s": estimate.time.seconds,
        "measured_step_s": measured.get("step_s"),
        "planner_peak_bytes": estimate.memory.peak,
        "fit_check_bytes": measured.get("predicted_bytes"),
        "measured_peak_bytes": measured.get("measured_peak_bytes"),
    }


def _attention_inputs(shape, seed: int = 0):
    batch, seq, heads, kv_heads, dim = shape
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim), jnp.float32)
    # Three documents per row and some padding: the packed case every implementation must honour.
    bounds = np.array([0, seq // 4, seq // 2, seq - seq // 8, seq])
    segments = np.zeros((batch, seq), np.int32)
    for i in range(3):
        segments[:, bounds[i]:bounds[i + 1]] = i + 1
    return q, k, v, jnp.asarray(segments)


def _timed_grad(fn, args, repeats: int) -> tuple[jax.Array, float]:
    """(fn's output, median seconds of forward + backward) for fn(q, k, v)."""
    both = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    out = jax.block_until_ready(jax.jit(fn)(*args))
    jax.block_until_ready(both(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(both(*args))
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def attention_rows(shape, window: int, repeats: int, budget: Budget, on_gpu: bool) -> list[dict]:
    """Each implementation's largest difference from XLA's fp32 result and its forward + backward time (bf16)."""
    q, k, v, segments = _attention_inputs(shape)
    k_rep, v_rep = (jnp.repeat(t, shape[2] // shape[3], axis=2) for t in (k, v))
    reference = model_layers.causal_attention(q, k_rep, v_rep, "xla", segments)
    cases = [(f"packed, {impl}", impl, None) for impl in ("xla", "jaxpar_xla", "cudnn")]
    cases += [(f"window {window}, mask (the definition)", "mask", window)]
    cases += [(f"window {window}, {impl} local_window_size", impl, window) for impl in ("xla", "cudnn")]
    windowed = _windowed_xla(q, k_rep, v_rep, window)
    rows = []
    for name, impl, win in cases:
        if impl == "cudnn" and not on_gpu:
            rows.append({"case": name, "skipped": NOT_ON_CPU})
            continue
        if budget.left() <= 0:
            rows.append({"case": name, "skipped": "time budget spent"})
            continue
        bf = tuple(t.astype(jnp.bfloat16) for t in (q, k_rep, v_rep))
        if win is None:
            fn = lambda a, b, c, impl=impl: model_layers.causal_attention(a, b, c, impl, segments)  # noqa: E731
        elif impl == "mask":
            fn = lambda a, b, c: _windowed_xla(a, b, c, window)  # noqa: E731
        else:
            fn = lambda a, b, c, impl=impl: window_attention(a, b, c, window, impl)  # noqa: E731
        out, seconds = _timed_grad(fn, bf, repeats)
        error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - (reference if win is None else windowed))))
        rows.append({"case": name, "max_abs_error_vs_xla_fp32": error, "fwd_bwd_s": seconds})
    return rows


def window_attention(q, k, v, window: int, implementation: str):
    """Sliding-window causal attention as `jax.nn.dot_product_attention` takes the window: (keys before,
    keys after) each query, so a window of W tokens (the query and W - 1 before it) is (W - 1, 0).
    cuDNN's row runs what a sliding layer runs in training (`attention_pattern.attend`: its window
    traced, the kernel picked by a `lax.cond`)."""
    if implementation == "cudnn":
        return attend(q, k, v, "cudnn", None, Pattern(jnp.asarray(window, jnp.int32), span=window))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0), implementation=implementation)


def _windowed_xla(q, k, v, window: int):
    """Causal attention where each query sees itself and the `window` - 1 keys before it (the definition)."""
    seq = q.shape[1]
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    mask = jnp.asarray((j <= i) & (j > i - window))[None, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def check(size: str, steps: int, budget_s: float, layers: int | None = None, seq: int | None = None,
          attention_repeats: int = 3, precisions: list[str] | None = None) -> dict:
    """Every section; the JSON-able result. `precisions`: bf16 and FP8 recipes to time (None: bf16 and every recipe)."""
    budget = Budget(budget_s)
    device = jax.devices()[0]
    config = model_config(size, layers, seq)
    profile = hardware_profile(device)
    peak = None if device.platform == "cpu" else profile.peak("bfloat16")  # the nominal CPU peak is no MFU base
    recipes = fp8_recipes(config) if precisions is None else [p for p in precisions if p != "bf16"]
    steps_out = step_rows(config, recipes, steps, budget, peak)
    bf16 = steps_out[0]
    planner = planner_row(config, device, bf16) if "skipped" not in bf16 else {"skipped": "no bf16 step measured"}
    m = config.model
    shape = (config.train.global_batch_size, config.train.seq_len, m.num_attention_heads, m.num_key_value_heads,
             m.hidden_size // m.num_attention_heads)
    window = max(2, config.train.seq_len // 8)
    attention = attention_rows(shape, window, attention_repeats, budget, device.platform == "gpu")
    return {
        "device": device.device_kind, "platform": device.platform, "jax": jax.__version__, "python": platform.python_version(),
        "size": size, "layers": m.num_hidden_layers, "seq_len": config.train.seq_len,
        "global_batch_size": config.train.global_batch_size, "budget_s": budget_s,
        "elapsed_s": budget_s - budget.left(), "peak_bf16_flops": peak,
        "step": steps_out, "planner": planner, "attention": attention,
    }


def _mib(x) -> str:
    return NOT_ON_CPU if x is None else f"{x / 2**20:,.1f}"


def markdown(result: dict) -> str:
    """The result as the tables docs/gpu_check.md shows."""
    shape = "Llama 3.1 8B widths" if result["size"] == "8b" else "a tiny Llama"
    out = [f"{result['device']} ({result['platform']}), jax {result['jax']}: {shape}, "
           f"{result['layers']} layers, batch {result['global_batch_size']} x {result['seq_len']} tokens; "
           f"{result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget", ""]
    out += ["| precision | step (s) | tokens/s | MFU (bf16 peak) | compile (s) | loss |", "| --- | --- | --- | --- | --- | --- |"]
    for row in result["step"]:
        if "skipped" in row:
            out.append(f"| {row['precision']} | skipped: {row['skipped']} | | | | |")
            continue
        mfu = NOT_ON_CPU if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        out.append(f"| {row['precision']} | {row['step_s']:.4f} | {row['tokens_per_s']:.0f} | {mfu} | "
                   f"{row['compile_s']:.1f} | {row['loss']:.4f} |")
    p = result["planner"]
    if "skipped" not in p:
        out += ["", "| quantity | predicted | measured |", "| --- | --- | --- |",
                f"| step time (s), planner on {p['hardware']} | {p['predicted_step_s']:.4f} | {p['measured_step_s']:.4f} |",
                f"| memory per device (MiB), fit check | {_mib(p['fit_check_bytes'])} | {_mib(p['measured_peak_bytes'])} |",
                f"| memory per device (MiB), planner | {_mib(p['planner_peak_bytes'])} | {_mib(p['measured_peak_bytes'])} |"]
    out += ["", "| attention (bf16) | max abs error vs XLA fp32 | fwd + bwd (s) |", "| --- | --- | --- |"]
    for row in result["attention"]:
        if "skipped" in row:
            out.append(f"| {row['case']} | skipped: {row['skipped']} | |")
        else:
            out.append(f"| {row['case']} | {row['max_abs_error_vs_xla_fp32']:.2e} | {row['fwd_bwd_s']:.4f} |")
    return "\n".join(out) + "\n"


def write(result: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = (os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.md"))
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    return paths
