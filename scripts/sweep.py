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

from jaxpar import command
from jaxpar.command import Command, Flag

FLAGS = (
    Flag("devices", int, 8, "emulated CPU devices", at_least=1),
    Flag("out", str, "", "output directory", required=True),
    Flag("hardware", str, "a100-80g", "hardware profile for step time and fit"),
    Flag("global_batch_size", int, None, "override train.global_batch_size", at_least=1),
    Flag("seq_len", int, None, "override train.seq_len", at_least=1),
    Flag("zero_stages", list, "0,1,3", "ZeRO stages to try where mesh.data > 1", choices=("0", "1", "3")),
    Flag("remats", list, "", "remat policies to try (default: the config's)", choices=("auto", "none", "full", "save_dots")),
    Flag("limit", int, 0, "compile at most this many layouts (0: all)", at_least=0),
    Flag("microbatch_rows", int, 0, "rows per microbatch per data replica on every mesh (0: the config's accumulation keys)",
         at_least=0),
    Flag("plots", bool, True, "write PNG plots (needs matplotlib)"),
    Flag("reprice", bool, False, "do not compile: re-price OUT/compiled.pkl from an earlier run with the current model"),
    Flag("recompile_gradient", list, "", "with --reprice: compile again the layouts whose gradient strategy is one of these "
         "(e.g. per_rank, after its code changed); the rest are re-priced from OUT/compiled.pkl"),
    Flag("recompile_zero_over_context", bool, False, "with --reprice: compile again the layouts whose ZeRO spans data x context "
         "(parallel.zero_axes); the rest are re-priced from OUT/compiled.pkl"),
)


def checks(args) -> list[str]:
    from jaxpar.analysis.cost.hardware import PROFILES

    if args.hardware not in PROFILES:
        return [f"--hardware: unknown hardware {args.hardware!r}; known: {', '.join(PROFILES)}"]
    if args.reprice and not os.path.isfile(os.path.join(args.out, "compiled.pkl")):
        return [f"--reprice: {os.path.join(args.out, 'compiled.pkl')} does not exist (compile first, without --reprice)"]
    if (args.recompile_gradient or args.recompile_zero_over_context) and not args.reprice:
        return ["--recompile_gradient and --recompile_zero_over_context go with --reprice"]
    return []


def run(args, config) -> None:
    # Before jax starts its backends: N emulated devices; LLVM at -O0 halves compile time and leaves the
    # XLA graph (buffers, collectives) unchanged.
    os.environ["XLA_FLAGS"] = " ".join([
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={args.devices}",
        "--xla_backend_optimization_level=0",
    ]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import csv

    from jaxpar.analysis.planner.candidates import Screen, Space, candidates
    from jaxpar.analysis.reports import sweep as sw

    if args.global_batch_size:
        config.train.global_batch_size = args.global_batch_size
    if args.seq_len:
        config.train.seq_len = args.seq_len
    space = Space.of_config(
        zero_stages=tuple(int(z) for z in args.zero_stages), remats=tuple(args.remats) or None, microbatch_rows=args.microbatch_rows
    )
    os.makedirs(args.out, exist_ok=True)
    pickled = os.path.join(args.out, "compiled.pkl")
    start = time.perf_counter()
    screen = Screen(config, args.devices)
    if args.reprice:
        from jaxpar.analysis.cost.comm_zero import spans_context

        again, zero = set(args.recompile_gradient), args.recompile_zero_over_context
        rows = sw.reprice(
            config, pickled, args.devices, args.hardware,
            recompile=(lambda layout: layout.gradient.value in again or (zero and spans_context(layout))) if again or zero else None,
        )
        if again or zero:
            sw.save(rows, pickled)
        for candidate in candidates(config, args.devices, space):  # the refusal counts, as when compiled
            screen.admit(candidate)
        with open(os.path.join(args.out, "sweep.md")) as f:  # keep the compiling run's command and time
            notes = [line.rstrip() for line in f.read().splitlines()[2:4]]
        notes.append(f"Re-priced with the current model: `python scripts/sweep.py {' '.join(sys.argv[1:])}`.")
    else:
        rows, screen = sw.sweep(config, args.devices, args.hardware, space=space, limit=args.limit or None)
        sw.save(rows, pickled)
        seconds = time.perf_counter() - start
        notes = [
            f"Command: `python scripts/sweep.py {' '.join(sys.argv[1:])}`",
            f"Sweep wall time: {seconds:.0f} s for {len(rows)} compiles ({os.cpu_count()} cores, shared with other jobs).",
        ]

    records = [sw.record(r) for r in rows]
    for name, table in (("sweep.csv", records), ("collectives.csv", [c for r in rows for c in sw.collective_records(r)])):
        with open(os.path.join(args.out, name), "w", newline="") as f:
            if table:
                writer = csv.DictWriter(f, fieldnames=list(table[0]))
                writer.writeheader()
                writer.writerows(table)
    title = f"{os.path.basename(args.config)} on {args.devices} devices ({args.hardware} for time and fit)"
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(sw.markdown(rows, screen, title=title, notes=notes))
    if args.plots and rows:
        from jaxpar.analysis.reports.plots import plot_memory, plot_step_time

        plot_memory(records, os.path.join(args.out, "memory.png"), title=f"Per-device memory: {title}", usable_bytes=rows[0].usable)
        plot_step_time(records, os.path.join(args.out, "step_time.png"), title=f"Predicted step time: {title}")
    print(f"{len(rows)} layouts in {time.perf_counter() - start:.0f} s; {screen.summary()}; wrote {args.out}/sweep.csv, sweep.md")


COMMANDS = (Command(None, "compile every mesh of a config on N emulated devices beside the analytic model", run, flags=FLAGS,
                    config="required", devices=False, checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
