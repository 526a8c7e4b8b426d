"""Compile every mesh of a config on N emulated devices and set the analytic model beside each.

    python scripts/sweep.py --config=configs/llama3_70b.py --devices=8 --out=/tmp/sweep70b \
        [--hardware=a100-80g] [--global_batch_size=..] [--seq_len=..] [--zero_stages=0,1,3] \
        [--remats=full] [--microbatch_rows=1] [--limit=0] [--config.X=...]

Enumerates the meshes (data, pipeline, context, expert, tensor) preflight admits, with each ZeRO
stage where mesh.data > 1 (and each remat policy in --remats; default the config's), AOT-compiles
the real train step for each on abstract inputs, and writes DIR/sweep.csv (one row per layout),
DIR/collectives.csv (per layout, collective kind and mesh axes), DIR/sweep.md and two PNG plots.
See `jaxpar.analysis.reports.sweep` for the columns.
"""

import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_HARDWARE = flags.DEFINE_string("hardware", "a100-80g", "Hardware profile for step time and fit.")
_BATCH = flags.DEFINE_integer("global_batch_size", None, "Override train.global_batch_size.")
_SEQ = flags.DEFINE_integer("seq_len", None, "Override train.seq_len.")
_ZERO = flags.DEFINE_list("zero_stages", ["0", "1", "3"], "ZeRO stages to try where mesh.data > 1.")
_REMATS = flags.DEFINE_list("remats", [], "Remat policies to try (default: the config's).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Compile at most this many layouts (0: all).")
_ROWS = flags.DEFINE_integer(
    "microbatch_rows", 0, "Rows per microbatch per data replica on every mesh (0: the config's accumulation keys)."
)
_PLOTS = flags.DEFINE_bool("plots", True, "Write PNG plots (needs matplotlib).")
_REPRICE = flags.DEFINE_bool(
    "reprice", False, "Do not compile: re-price OUT/compiled.pkl from an earlier run with the current model."
)
_RECOMPILE = flags.DEFINE_list(
    "recompile_gradient", [], "With --reprice: compile again the layouts whose gradient strategy is one of these "
    "(e.g. per_rank, after its code changed); the rest are re-priced from OUT/compiled.pkl."
)
_RECOMPILE_ZERO = flags.DEFINE_bool(
    "recompile_zero_over_context", False, "With --reprice: compile again the layouts whose ZeRO spans data x context "
    "(parallel.zero_axes); the rest are re-priced from OUT/compiled.pkl."
)
flags.mark_flags_as_required(["config", "out"])


def main(argv):
    del argv
    # Before jax is imported: N emulated devices; LLVM at -O0 halves compile time and leaves the
    # XLA graph (buffers, collectives) unchanged.
    os.environ["XLA_FLAGS"] = " ".join([
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={_DEVICES.value}",
        "--xla_backend_optimization_level=0",
    ]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import csv

    from jaxpar.analysis.planner.candidates import Screen, Space, candidates
    from jaxpar.analysis.reports import sweep as sw

    config = _CONFIG.value
    if _BATCH.value:
        config.train.global_batch_size = _BATCH.value
    if _SEQ.value:
        config.train.seq_len = _SEQ.value
    space = Space.of_config(
        zero_stages=tuple(int(z) for z in _ZERO.value), remats=tuple(_REMATS.value) or None, microbatch_rows=_ROWS.value
    )
    os.makedirs(_OUT.value, exist_ok=True)
    pickled = os.path.join(_OUT.value, "compiled.pkl")
    start = time.perf_counter()
    screen = Screen(config, _DEVICES.value)
    if _REPRICE.value:
        from jaxpar.analysis.cost.comm_zero import spans_context

        again, zero = set(_RECOMPILE.value), _RECOMPILE_ZERO.value
        rows = sw.reprice(
            config, pickled, _DEVICES.value, _HARDWARE.value,
            recompile=(lambda layout: layout.gradient.value in again or (zero and spans_context(layout))) if again or zero else None,
        )
        if again or zero:
            sw.save(rows, pickled)
        for candidate in candidates(config, _DEVICES.value, space):  # the refusal counts, as when compiled
            screen.admit(candidate)
        with open(os.path.join(_OUT.value, "sweep.md")) as f:  # keep the compiling run's command and time
            notes = [line.rstrip() for line in f.read().splitlines()[2:4]]
        notes.append(f"Re-priced with the current model: `python scripts/sweep.py {' '.join(sys.argv[1:])}`.")
    else:
        rows, screen = sw.sweep(config, _DEVICES.value, _HARDWARE.value, space=space, limit=_LIMIT.value or None)
        sw.save(rows, pickled)
        seconds = time.perf_counter() - start
        notes = [
            f"Command: `python scripts/sweep.py {' '.join(sys.argv[1:])}`",
            f"Sweep wall time: {seconds:.0f} s for {len(rows)} compiles ({os.cpu_count()} cores, shared with other jobs).",
        ]

    records = [sw.record(r) for r in rows]
    for name, table in (("sweep.csv", records), ("collectives.csv", [c for r in rows for c in sw.collective_records(r)])):
        with open(os.path.join(_OUT.value, name), "w", newline="") as f:
            if table:
                writer = csv.DictWriter(f, fieldnames=list(table[0]))
                writer.writeheader()
                writer.writerows(table)
    config_name = os.path.basename(sys.argv[[a.startswith("--config=") for a in sys.argv].index(True)].split("=", 1)[1])
    title = f"{config_name} on {_DEVICES.value} devices ({_HARDWARE.value} for time and fit)"
    with open(os.path.join(_OUT.value, "sweep.md"), "w") as f:
        f.write(sw.markdown(rows, screen, title=title, notes=notes))
    if _PLOTS.value and rows:
        from jaxpar.analysis.reports.plots import plot_memory, plot_step_time

        plot_memory(rows, os.path.join(_OUT.value, "memory.png"), title=f"Per-device memory: {title}")
        plot_step_time(rows, os.path.join(_OUT.value, "step_time.png"), title=f"Predicted step time: {title}")
    print(f"{len(rows)} layouts in {time.perf_counter() - start:.0f} s; {screen.summary()}; wrote {_OUT.value}/sweep.csv, sweep.md")


if __name__ == "__main__":
    app.run(main)
