"""Train a model from a config file; resume a workdir's run; never clobber one.

  python scripts/train.py --config=configs/llama_tiny.py --workdir=/tmp/run \\
      [--config.train.steps=50 ...] [--cpu_devices=8] [--overwrite] [--plan=a100-80g]

Exit codes: 0 done; 2 bad input (flags, config, data, workdir; nothing was written, except for a bad
record found in the data after training started: a checkpoint first), one line per problem on stderr,
or a step that does not fit the devices' memory (checked before anything is allocated: needed vs
available per device, the largest term, the planner's best layout that fits);
1 a checkpoint could not be written or read (a full disk included); 3 stopped for non-finite values;
4 another process of a multi-process run was lost (`jaxpar.peers`); 130 / 143 interrupted by
SIGINT / SIGTERM (during start-up: nothing changed; in the loop: after a final checkpoint; a second
signal quits at once, without one).
Multi-process: see `--help` and README ("Multi-process runs").
"""

from __future__ import annotations

import sys

from jaxpar import command
from jaxpar.command import Command, Flag, error

EXIT_USAGE, EXIT_CHECKPOINT, EXIT_NONFINITE = 2, 1, 3

FLAGS = (
    Flag("workdir", str, "", "where config.json, metrics.jsonl, checkpoints/ and the run's lock live; a workdir holding a run "
         "with a fitting checkpoint is resumed, any other earlier run refused", required=True),
    Flag("overwrite", bool, False, "replace an earlier run in --workdir: moved aside once the new run is known to start, deleted "
         "at the new run's first checkpoint, put back if it fails before"),
    Flag("plan", str, "", "a hardware profile (a100-80g, h100-80g, h200, tpu-v5p, ...): set the mesh, ZeRO stage, remat and "
         "microbatch keys to the planner's best layout for the visible device count, printing the choice and why; "
         "--config.KEY=VALUE still wins"),
    Flag("elastic_devices", int, 0, "the device count the config is laid out for (else $JAXPAR_ELASTIC_DEVICES, which "
         "launch_local.py --elastic sets): on fewer devices, with mesh.data=-1, the microbatch count grows as the data "
         "replicas shrink, so the global batch and each device's rows stay (jaxpar.train.elastic); with --plan the "
         "planner lays the run out instead", at_least=0),
    Flag("coordinator", str, None, "HOST:PORT of process 0, to join a multi-process run (else JAX_COORDINATOR_ADDRESS / "
         "JAX_NUM_PROCESSES / JAX_PROCESS_ID, else a SLURM job step with several tasks, else one process)"),
    Flag("num_processes", int, None, "processes of the multi-process run", at_least=1),
    Flag("process_id", int, None, "this process's index in the multi-process run", at_least=0),
)


def run(args, config) -> int:
    import jax

    from jaxpar import distributed
    from jaxpar.checkpoint import CheckpointError
    from jaxpar.train.elastic import ElasticError
    from jaxpar.train.fit import DoesNotFit
    from jaxpar.train.loop import train
    from jaxpar.train.nonfinite import NonFiniteStop
    from jaxpar.train.preflight import ConfigError
    from jaxpar.train.signals import Interrupted
    from jaxpar.train.workdir import WorkdirError

    plan_errors = ()
    if args.plan:  # the planner (the whole cost model) is imported only when asked for
        from jaxpar.analysis.cost.hardware import HardwareError
        from jaxpar.analysis.planner import PlanError

        plan_errors = (PlanError, HardwareError)
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        explicit = {key for key, _ in args.overrides}
        if args.plan:
            apply_plan(config, args.plan, jax.device_count(), explicit=explicit)
        else:
            keep_elastic_rows(config, args.elastic_devices, jax.device_count(), explicit)
        choose_remat(config, jax.devices())
        history = train(config, args.workdir, overwrite=args.overwrite)
    except DoesNotFit as e:  # before ConfigError, which it is: one line with the planner's way out
        error(f"{e}; {fit_advice(config, e)}")
        return EXIT_USAGE
    except (ConfigError, ElasticError, WorkdirError, distributed.DistributedError, *plan_errors) as e:
        error(e)
        return EXIT_USAGE
    except CheckpointError as e:
        error(e)
        return EXIT_CHECKPOINT
    except NonFiniteStop as e:
        error(e)
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


def keep_elastic_rows(config, full_devices: int, devices: int, explicit: set[str]) -> None:
    """`--elastic_devices` (or the launcher's environment): the microbatch count that keeps the full
    run's rows per device on the devices there are now."""
    import os

    import jax

    from jaxpar.train.elastic import ENV, ElasticError, keep_rows

    value = os.environ.get(ENV, "") if not full_devices else str(full_devices)
    if value and not value.isdigit():
        raise ElasticError(f"${ENV}={value!r}: must be a device count")
    full = int(value or 0)
    line = keep_rows(config, full, devices, explicit) if full else None
    if line and jax.process_index() == 0:
        print(line, flush=True)


def choose_remat(config, devices) -> None:
    """`parallel.remat="auto"` on an accelerator whose memory limit is known: the cost model's fastest
    policy that fits (`jaxpar.analysis.planner.remat`, imported only then); on a CPU the backend table."""
    import jax

    from jaxpar.train.fit import available_per_device
    from jaxpar.train.preflight import ConfigError

    if config.parallel.remat != "auto" or devices[0].platform == "cpu":
        return
    available, _ = available_per_device(devices)
    if available is None:
        return
    from jaxpar.analysis.planner.remat import choose

    try:
        config.parallel.remat, line = choose(config, devices, available)
    except ConfigError:  # a config the model cannot price: preflight says why, in its own words
        return
    if jax.process_index() == 0:
        print(line, flush=True)


def fit_advice(config, error) -> str:
    """The planner's best layout for these devices (imported only now: a run that fits never loads it)."""
    import jax

    from jaxpar.analysis.planner.fit_advice import advice

    try:
        return advice(config, jax.devices(), error.available)
    except Exception as e:  # noqa: BLE001 - the fit verdict stands even if the planner cannot help
        return f"the planner found no advice ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def apply_plan(config, hardware: str, num_devices: int, explicit: set[str]) -> None:
    """Fills the layout keys from the planner's best layout for `num_devices` devices of
    `hardware` (before preflight: a plan that fits nothing raises PlanError, one line), and sets
    `train.predicted_step_s` to its predicted step time, which every metrics record then carries."""
    import jax

    from jaxpar.analysis.planner import apply_layout, best_plan, plan_text, prediction_line

    plan = best_plan(config, hardware, num_devices, fixed=explicit)
    keys = {k: v for k, v in plan.best.candidate.values.items() if k not in explicit}
    apply_layout(config, keys, explicit)
    config.train.predicted_step_s = float(plan.best.estimate.time.seconds)
    if jax.process_index() == 0:
        chosen = " ".join(f"--config.{key}={value}" for key, value in sorted(keys.items()))
        print(f"plan for {num_devices} x {hardware}: {chosen}")
        print(plan_text.choice(plan))
        platform = jax.devices()[0].platform
        print(prediction_line(plan) + ("" if platform == "gpu" or platform == "tpu" else f"; this run is on {platform} devices"),
              flush=True)


COMMANDS = (Command(None, "train a model from a config file; resume a workdir's run", run, flags=FLAGS, config="required"),)



def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
