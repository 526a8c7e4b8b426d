"""Pipeline schedules: their tables, their cost on emulated devices, stage balance and vocab memory.

  python scripts/pipeline.py schedule --schedule=1f1b --stages=4 --microbatches=8
  python scripts/pipeline.py schedule --schedule=zb_v --stages=4 --microbatches=8 [--config=configs/llama3_70b.py]
  python scripts/pipeline.py report [--stages=4 --microbatches=8 --data=2 --schedules=1f1b,zb_h1 --nobaseline]
  python scripts/pipeline.py balance [--stages=2 --microbatches=4 --layers=8 --vocab_size=32000]
  python scripts/pipeline.py memory [--config=configs/llama3_70b.py --pipeline=8 --devices=32]

`schedule` prints a schedule's table (pure Python: no device, nothing compiled), its bubble (table vs
theory) and peak stash per rank; with a config also the stage split (explicit or `auto`) and each
stage's modelled cost share. `report` runs every schedule's real train step on a tiny Llama (emulated
CPU devices) and compares bubble, stash, compiled memory, pipeline traffic, step time and modelled busy
time (`jaxpar.bench.pipeline_report`). `balance` sets equal beside cost-balanced stage splits for both
vocab placements (`jaxpar.bench.pipeline_balance`). `memory` reads per-device parameter and optimizer
bytes by part of the model from the train state's shardings, vocab tables on every rank ("ends") or
split over them ("spread"), allocating nothing (`jaxpar.bench.pipeline_memory`). On CPU the emulated
devices share the host's cores: a measured step is total work, the modelled busy time what a device
per rank would see.
"""

from __future__ import annotations

import sys

from jaxpar import command
from jaxpar.bench import refusing_bad_configs
from jaxpar.command import Command, Flag, UsageError
from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES

VOCAB = ("spread", "ends")


def run_schedule(args, config):
    from jaxpar.parallel.pipeline.checks import peak_in_flight, validate
    from jaxpar.parallel.pipeline.schedules import schedule_kind
    from jaxpar.parallel.pipeline.table import bubble_fraction, render

    kind, p, m = schedule_kind(args.schedule), args.stages, args.microbatches
    v = args.virtual_stages or kind.default_virtual_stages
    try:
        schedule = kind.table(p, m, v)
    except ValueError as e:
        raise UsageError(str(e)) from None
    split = None
    if config is not None:  # checked before anything is printed
        from jaxpar.models import facts
        from jaxpar.parallel.pipeline import balance

        try:
            split = balance.parse_split(args.stage_layers)
        except ValueError as e:
            raise UsageError(f"--stage_layers: {e}") from None
        if split == balance.AUTO:
            split = balance.auto_split(facts(config.model), config.train.seq_len, schedule, placement=args.vocab)
        elif problems := balance.split_problems(split, config.model.num_hidden_layers, p, v):
            raise UsageError(f"--stage_layers={args.stage_layers}: " + "; ".join(problems))
    validate(schedule)
    print(render(schedule))
    print()
    print(f"bubble (table, lockstep costs): {bubble_fraction(schedule):.4f}")
    print(f"bubble (theory):                {kind.bubble(p, m, v):.4f}")
    unit = "microbatches" if v == 1 else "(microbatch, virtual stage) stashes"
    print(f"peak in-flight {unit} per rank: {peak_in_flight(schedule)}")
    if split is not None:
        print()
        print("\n".join(balance.split_report(facts(config.model), config.train.seq_len, schedule, split, args.vocab)))


def _emulate(count: int) -> None:
    """`count` CPU devices, without forcing the CPU platform (an accelerator host keeps its devices)."""
    import jax

    jax.config.update("jax_num_cpu_devices", count)


def _baseline_problems(args) -> list[str]:
    """The baseline spreads the pipeline's global batch over stages x data replicas: its rows must divide."""
    rows = args.microbatches * args.microbatch_rows
    if args.baseline and rows % args.stages:
        return [f"--microbatches={args.microbatches} x --microbatch_rows={args.microbatch_rows} = {rows} rows per data replica do not "
                f"divide over the --baseline run's --stages={args.stages} data replicas; change one, or pass --nobaseline"]
    return []


@refusing_bad_configs
def run_report(args, _):
    from jaxpar.bench.pipeline_report import Report, report

    _emulate(max(8, args.stages * args.data))
    report(Report(args.stages, args.microbatches, args.virtual_stages, args.data, args.layers, args.hidden, args.seq_len,
                  args.microbatch_rows, args.steps, args.stage_layers, args.vocab, args.vocab_size, tuple(args.schedules),
                  args.baseline))


@refusing_bad_configs
def run_balance(args, _):
    import os

    if args.one_thread_per_device:  # before JAX starts its backends
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    from jaxpar.bench.pipeline_balance import Balance, report

    _emulate(args.stages)
    report(Balance(args.stages, args.microbatches, args.schedule, args.layers, args.vocab_size, args.hidden, args.seq_len,
                   args.microbatch_rows, args.steps))


@refusing_bad_configs
def run_memory(args, config):
    command.use_cpu_devices(args.devices)
    import jax

    from jaxpar.bench.pipeline_memory import report

    report(config, args.pipeline, jax.devices()[: args.devices])


STAGES = Flag("stages", int, 4, "pipeline ranks p (one emulated device each)", at_least=1)
MICROBATCHES = Flag("microbatches", int, 8, "microbatches m per step", at_least=1)
STAGE_LAYERS = Flag("stage_layers", str, "auto", "parallel.pipeline_stage_layers: 'auto' or a comma-separated count per stage")
VOCAB_AT = Flag("vocab", str, "spread", "parallel.pipeline_vocab: where embedding and LM head run", choices=VOCAB)
TINY = (  # the tiny Llama that report and balance run
    Flag("layers", int, 8, "decoder layers", at_least=1),
    Flag("microbatch_rows", int, 2, "rows per microbatch (per data replica)", at_least=1),
)

COMMANDS = (
    Command("schedule", "a schedule's table, bubble and stash (no devices); with --config its stage split", run_schedule, flags=(
        Flag("schedule", str, "1f1b", "the pipeline schedule", choices=SCHEDULE_NAMES),
        STAGES, MICROBATCHES,
        Flag("virtual_stages", int, 0, "virtual stages v per rank (0: the schedule's own, from its record)",
             at_least=0),
        STAGE_LAYERS, VOCAB_AT,
    ), config="optional", devices=False),
    Command("report", "every schedule's train step on emulated devices: bubble, memory, traffic, time", run_report, flags=(
        STAGES, MICROBATCHES,
        Flag("virtual_stages", int, 2, "v for interleaved_1f1b (zb_v and dualpipev take 2)", at_least=1),
        Flag("data", int, 2, "data-parallel replicas beside the pipeline", at_least=1),
        *TINY,
        Flag("hidden", int, 128, "hidden size", at_least=1),
        Flag("seq_len", int, 64, "sequence length", at_least=1),
        Flag("steps", int, 5, "timed steps after one warm-up step", at_least=1),
        STAGE_LAYERS, VOCAB_AT,
        Flag("vocab_size", int, 256, "vocab size", at_least=1),
        Flag("schedules", list, "", "schedules to run (default: every one)", choices=SCHEDULE_NAMES),
        Flag("baseline", bool, True, "also run the same global batch without a pipeline"),
    ), devices=False, checks=lambda args: _baseline_problems(args)),
    Command("balance", "equal against cost-balanced stage splits, modelled and measured", run_balance, flags=(
        Flag("stages", int, 2, "pipeline ranks p (one emulated device each)", at_least=1),
        Flag("microbatches", int, 4, "microbatches m per step", at_least=1),
        Flag("schedule", str, "1f1b", "pipeline schedule (full backward)", choices=("gpipe", "1f1b")),
        *TINY,
        Flag("vocab_size", int, 32000, "vocab size", at_least=1),
        Flag("hidden", int, 256, "hidden size", at_least=1),
        Flag("seq_len", int, 128, "sequence length", at_least=1),
        Flag("one_thread_per_device", bool, False, "XLA:CPU without intra-op threads: each emulated device runs on one thread"),
        Flag("steps", int, 9, "timed steps per row after two warm-up steps (median reported)", at_least=1),
    ), devices=False),
    Command("memory", "per-device parameter and optimizer bytes by part, vocab on every rank or split", run_memory, flags=(
        Flag("pipeline", int, 0, "mesh.pipeline (0: the config's)", at_least=0),
        Flag("devices", int, 32, "emulated CPU devices", at_least=1),
    ), config="optional", default_config="configs/llama3_70b.py", devices=False),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
