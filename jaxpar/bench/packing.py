"""`scripts/bench.py packing`: packing's cost: a config's train step on packed documents beside one
sequence per row.

Per attention kernel (`parallel.attention_impl`), three batches of the same shape [G, S+1] tokens:
- `unpacked`: token rows, one sequence per row (the harness's random batch): plain causal attention,
  no segment ids, a plain mean loss;
- `stdlib`: documents whose lengths are drawn from the stdlib corpus's files (byte-tokenized, as
  `data.source=stdlib` reads them: most are longer than a row and fill rows as pieces, the short
  ones pack several to a row), packed by the production packer into [G, 2, S+1];
- `short`: documents of S/16 .. S/4 tokens (16 .. 64 on the bench config), several to a row.
The packed batches are one executable (segment-masked attention, target weights); token rows compile
their own. After compiling all of them, blocks of `steps` steps rotate over the batches `repeats`
times in this one process (so load on the machine hits them alike); the medians and the ratio to
`unpacked` of the same kernel are printed, per kernel one line of wall time and one of this process's
CPU time per step, `attention=<impl> wall|cpu unpacked_ms=.. stdlib_ms=.. short_ms=.. (ratios)`.
"""

from __future__ import annotations

import os
import statistics

import jax
import numpy as np

from jaxpar.train import harness

KINDS = ("unpacked", "stdlib", "short")


def documents(kind: str, config, rng) -> list[np.ndarray]:
    """Random token ids in lengths of the kind (enough to fill the batch)."""
    from jaxpar.data.sources import stdlib_files

    rows, width = config.train.global_batch_size, config.train.seq_len + 1
    if kind == "stdlib":
        root, rel = stdlib_files()
        sizes = np.array([os.path.getsize(os.path.join(root, r)) for r in rel])
        lengths = np.minimum(rng.choice(sizes, 4 * rows), rows * width)  # what a batch can hold
    else:
        low = max(2, width // 16)  # 16 .. 64 tokens on the bench config (S = 256)
        lengths = rng.integers(low, max(width // 4, low) + 1, 8 * rows)
    return [rng.integers(0, config.model.vocab_size, n).astype(np.int32) for n in lengths if n >= 2]


def batch_of(kind: str, config, seed: int = 0) -> tuple[np.ndarray, str]:
    """(the global batch as numpy, a one-line description)."""
    from jaxpar.data.packing import ListStream, Packer

    rng = np.random.default_rng(seed)
    shape = (config.train.global_batch_size, config.train.seq_len + 1)
    if kind == "unpacked":
        return rng.integers(0, config.model.vocab_size, shape).astype(np.int32), "token rows"
    batch = next(Packer(ListStream(documents(kind, config, rng)), *shape))
    segments = batch[:, 1]
    per_row = np.mean([len(np.unique(r[r > 0])) for r in segments])
    return batch, f"{per_row:.1f} segments a row, {np.mean(segments == 0):.1%} padding"


def bench(config_for, label: str, attention: list[str], steps: int, repeats: int) -> dict:
    """`config_for(impl)`: the config with that attention kernel. Prints the comparison; returns
    {(impl, kind, "wall" | "cpu"): median ms per step}."""
    runs = {}
    for impl in attention:
        config = config_for(impl)
        program = harness.checked_build(config, jax.devices()[:1])
        for kind in KINDS:
            batch, described = batch_of(kind, config)
            run = harness.Harness(program, jax.block_until_ready(program.init()), jax.device_put(batch, program.batch_sharding))
            if kind == "short":  # the same shapes as stdlib's batch: its executable
                run.executable = runs[impl, "stdlib"].executable
            seconds = 0.0 if run.executable else run.compile()
            _, first = run.step()
            runs[impl, kind] = run
            print(f"attention={impl} {kind} ({described}): compile+first step {seconds + first:.1f}s", flush=True)
    wall, cpu = harness.rotating(runs, steps, repeats,
                                 lambda wall: " ".join(f"{i}/{k} {statistics.median(t) * 1e3:.0f}ms" for (i, k), t in wall.items()))
    config = config_for(attention[0])
    print(f"model={label} G={config.train.global_batch_size} S={config.train.seq_len} device={jax.devices()[0].device_kind}: "
          f"median ms/step of {repeats} x {steps} steps, rotating (cpu: this process's CPU time, all threads)")
    medians = {}
    for impl in attention:
        for name, times in (("wall", wall), ("cpu", cpu)):
            ms = {kind: statistics.median(times[impl, kind]) * 1e3 for kind in KINDS}
            medians.update({(impl, kind, name): value for kind, value in ms.items()})
            ratios = ", ".join(f"{kind} / unpacked = {ms[kind] / ms['unpacked']:.3f}" for kind in KINDS[1:])
            print(f"attention={impl} {name} " + " ".join(f"{kind}_ms={ms[kind]:.1f}" for kind in KINDS) + f"  ({ratios})")
    return medians
