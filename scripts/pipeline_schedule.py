"""Prints a pipeline schedule table, its bubble (table vs theory) and peak stash per rank.

    python scripts/pipeline_schedule.py --schedule=1f1b --stages=4 --microbatches=8
    python scripts/pipeline_schedule.py --schedule=interleaved_1f1b --stages=4 --microbatches=8 \
        --virtual_stages=2

Pure Python + numpy: no jax import, no device setup.
"""

from absl import app, flags

from jaxpar.parallel.pipeline.checks import peak_in_flight, validate
from jaxpar.parallel.pipeline.schedules import (
    SCHEDULE_NAMES,
    bubble_fraction,
    make_schedule,
    render,
    theoretical_bubble,
)

_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", SCHEDULE_NAMES, "Pipeline schedule.")
_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline ranks p.", lower_bound=1)
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "Microbatches m per step.", lower_bound=1)
_VIRTUAL = flags.DEFINE_integer(
    "virtual_stages", 1, "Virtual stages v per rank (interleaved_1f1b only).", lower_bound=1
)


def main(argv):
    del argv
    name, p, m, v = _SCHEDULE.value, _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value
    try:
        schedule = make_schedule(name, p, m, v)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    validate(schedule)
    print(render(schedule))
    print()
    print(f"bubble (table, lockstep costs): {bubble_fraction(schedule):.4f}")
    print(f"bubble (theory):                {theoretical_bubble(name, p, m, v):.4f}")
    unit = "microbatches" if v == 1 else "(microbatch, virtual stage) stashes"
    print(f"peak in-flight {unit} per rank: {peak_in_flight(schedule)}")


if __name__ == "__main__":
    app.run(main)
