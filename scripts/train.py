"""Train a model from a config file; resume a workdir's run; never clobber one.

  python scripts/train.py --config=configs/llama_tiny.py --workdir=/tmp/run \\
      [--config.train.steps=50 ...] [--cpu_devices=8] [--overwrite] [--plan=a100-80g]

Exit codes: 0 done; 2 bad input (flags, config, data, workdir; nothing was written), one line per
problem on stderr; 1 a checkpoint could not be written or read (a full disk included); 3 stopped
for non-finite values; 4 another process of a multi-process run was lost (`jaxpar.peers`); 130 /
143 interrupted by SIGINT / SIGTERM (during start-up: nothing changed; in the loop: after a final
checkpoint; a second signal quits at once, without one).
Multi-process: see `--help` and README ("Multi-process runs").
"""

from __future__ import annotations

import os
import sys

EXIT_USAGE, EXIT_CHECKPOINT, EXIT_NONFINITE = 2, 1, 3


def _error(message: str) -> None:
    for line in str(message).splitlines():
        print(f"error: {line}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        from jaxpar.train import cli

        args, config = cli.read(argv)
        if args.help:
            print(cli.USAGE)
            return 0
    except KeyboardInterrupt:
        print("interrupted before the run started; nothing was written", file=sys.stderr)
        return 130
    except cli.UsageError as e:
        _error(e)
        return EXIT_USAGE
    return run(args, config)


def run(args, config) -> int:
    import jax

    from jaxpar import distributed
    from jaxpar.checkpoint import CheckpointError
    from jaxpar.train.preflight import ConfigError
    from jaxpar.train.loop import train
    from jaxpar.train.nonfinite import NonFiniteStop
    from jaxpar.train.signals import Interrupted
    from jaxpar.train.workdir import WorkdirError

    plan_errors = ()
    if args.plan:  # the planner (the whole cost model) is imported only when asked for
        from jaxpar.analysis.hardware import HardwareError
        from jaxpar.analysis.planner import PlanError

        plan_errors = (PlanError, HardwareError)
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        if args.cpu_devices and not os.environ.get("JAX_NUM_CPU_DEVICES"):
            # Must happen before the first jax call creates the backends.
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        if args.plan:
            apply_plan(config, args.plan, jax.device_count(), explicit={key for key, _ in args.overrides})
        history = train(config, args.workdir, overwrite=args.overwrite)
    except (ConfigError, WorkdirError, distributed.DistributedError, *plan_errors) as e:
        _error(e)
        return EXIT_USAGE
    except CheckpointError as e:
        _error(e)
        return EXIT_CHECKPOINT
    except NonFiniteStop as e:
        _error(e)
        return EXIT_NONFINITE
    except Interrupted as e:
        print(e, file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted before training started; nothing of an earlier run was changed", file=sys.stderr)
        return 130
    if history and jax.process_index() == 0:
        print(f"done: {len(history)} steps, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
    return 0


def apply_plan(config, hardware: str, num_devices: int, explicit: set[str]) -> None:
    """Fills the layout keys from the planner's best layout for `num_devices` devices of
    `hardware` (before preflight: a plan that fits nothing raises PlanError, one line)."""
    import jax

    from jaxpar.analysis.planner import apply_layout, best_layout

    keys, why = best_layout(config, hardware, num_devices, fixed=explicit)
    apply_layout(config, keys, explicit)
    if jax.process_index() == 0:
        chosen = " ".join(f"--config.{key}={value}" for key, value in sorted(keys.items()))
        print(f"plan for {num_devices} x {hardware}: {chosen}")
        print(why, flush=True)


if __name__ == "__main__":
    sys.exit(main())
