"""`scripts/bench.py window`: a sliding layer's attention, forward + backward, beside full causal
attention of the same shape (issue 37 item 7), all timed in one invocation, alternating.

Contenders (fp32, one device, jitted value-and-grad of sum(out²)): the full causal kernel
(`jaxpar_xla`), the same kernel with the window as a mask (what a sliding layer cost before the
band), and the band kernel (`jaxpar.kernels.local_attention`) at each tile count. Each is compiled
and run once first; then `repeats` rounds time each once, and the medians are compared. The largest
difference of each output from the masked kernel's is printed beside its time.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def contenders(window: int, tiles: list[int]) -> dict:
    from jaxpar.kernels.attention import causal_attention, patterned_attention
    from jaxpar.kernels.local_attention import banded_attention

    out = {
        "full causal (jaxpar_xla)": lambda q, k, v: causal_attention(q, k, v),
        f"window {window} as a mask (jaxpar_xla)": lambda q, k, v: patterned_attention(q, k, v, None, window),
    }
    for n in tiles:
        out[f"window {window}, band of {n} tile(s)"] = lambda q, k, v, n=n: banded_attention(q, k, v, None, window, window, tiles=n)
    return out


def bench(seq: int, window: int, heads: int, kv_heads: int, head_dim: int, repeats: int, tiles: list[int]) -> list[str]:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (1, seq, kv_heads, head_dim)) for key in keys[1:])
    runs = {name: jax.jit(jax.value_and_grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))
            for name, f in contenders(window, tiles).items()}
    outputs = {name: jax.block_until_ready(jax.jit(f)(q, k, v)) for name, f in contenders(window, tiles).items()}
    for run in runs.values():
        jax.block_until_ready(run(q, k, v))
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run(q, k, v))
            times[name].append(time.perf_counter() - start)
    full = statistics.median(times["full causal (jaxpar_xla)"])
    masked = outputs[f"window {window} as a mask (jaxpar_xla)"]
    lines = [f"sequence {seq}, window {window}, {heads} query heads over {kv_heads} KV heads of {head_dim}, fp32, "
             f"{jax.devices()[0].device_kind}; medians of {repeats} alternating rounds", "",
             "| attention | forward + backward (s) | speed-up over full causal | max abs difference from the masked window |",
             "| --- | --- | --- | --- |"]
    for name, ts in times.items():
        median = statistics.median(ts)
        difference = "" if name.startswith("full") else f"{float(jnp.max(jnp.abs(outputs[name] - masked))):.1e}"
        lines.append(f"| {name} | {median:.4g} | {full / median:.2f}x | {difference} |")
    return lines
