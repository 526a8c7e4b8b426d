"""`scripts/bench.py collective_matmul`: what `parallel.collective_matmul` costs where nothing overlaps:
the train step on 8 emulated CPU devices, data 2 x tensor 4 with sequence parallelism and remat full,
each mode (`none`: the partitioner's gathers and scatters, `permutes`: jaxpar's exchanges) beside the
others in this one process.

Two sizes of MaxText's tiny Llama (`configs/maxtext_tiny.py`): `small` as it is (hidden 256, 4 layers,
8 x 256 tokens: the size first measured), `large` where tensor parallelism is what one would use
(hidden 768, 12 query / 4 KV heads, MLP 2048, 2 layers, 2 x 1024 tokens). After compiling every
contender, blocks of `steps` steps rotate over them `repeats` times, so load on the machine hits
them alike; printed per size: the median wall and CPU (this process, all threads) seconds per step
and each mode's ratio to the first.
"""

from __future__ import annotations

import statistics

import jax

from jaxpar.axes import DATA, MESH_AXES, TENSOR
from jaxpar.train import harness

DEVICES = 8
MESH = {DATA: 2, TENSOR: 4}
SIZES = {
    "small": ({}, {}),
    "large": (dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                   num_hidden_layers=2, max_position_embeddings=1024), dict(global_batch_size=2, seq_len=1024)),
}


def config_for(base, size: str, mode: str):
    """`base` (the tiny Llama) at `size` on data 2 x tensor 4, SP, remat full, collective matmul `mode`."""
    config = base.copy_and_resolve_references()
    model, train = SIZES[size]
    config.model.update(model)
    config.train.update(train)
    config.mesh.update({axis: MESH.get(axis, 1) for axis in MESH_AXES})
    config.parallel.update(sequence_parallel=True, remat="full", collective_matmul=mode)
    return config


def bench(base, sizes: list[str], modes: list[str], steps: int, repeats: int) -> dict:
    """Prints the comparison; returns {(size, mode, "wall" | "cpu"): median seconds per step}."""
    runs = {}
    for size in sizes:
        for mode in modes:
            run = harness.prepare(config_for(base, size, mode), jax.devices()[:DEVICES])
            seconds = run.compile()
            _, first = run.step()
            runs[size, mode] = run
            print(f"{size} collective_matmul={mode}: compile {seconds:.1f}s, first step {first:.2f}s", flush=True)
    wall, cpu = harness.rotating(runs, steps, repeats,
                                 lambda wall: " ".join(f"{s}/{m} {statistics.median(t):.3f}s" for (s, m), t in wall.items()))
    print(f"median s/step of {repeats} x {steps} steps, rotating; data 2 x tensor 4, SP, remat full "
          f"(cpu: this process's CPU time, all threads)")
    medians = {}
    for size in sizes:
        for name, times in (("wall", wall), ("cpu", cpu)):
            s = {mode: statistics.median(times[size, mode]) for mode in modes}
            medians.update({(size, mode, name): value for mode, value in s.items()})
            ratios = ", ".join(f"{mode} / {modes[0]} = {s[mode] / s[modes[0]]:.3f}" for mode in modes[1:])
            print(f"{size} {name} " + " ".join(f"{mode}={s[mode]:.3f}s" for mode in modes) + f"  ({ratios})")
    return medians
