"""Prints a pipeline schedule table, its bubble (table vs theory) and peak stash per rank; with a
model config also the stage split (explicit or `auto`) and each stage's modelled cost share.

    python scripts/pipeline_schedule.py --schedule=1f1b --stages=4 --microbatches=8
    python scripts/pipeline_schedule.py --schedule=interleaved_1f1b --stages=4 --microbatches=8 \
        --virtual_stages=2
    python scripts/pipeline_schedule.py --config=configs/llama3_70b.py --stages=4 --microbatches=8 \
        [--stage_layers=auto|21,20,20,19] [--vocab=spread|ends]

No device setup: the table is pure Python + numpy, the cost model arithmetic on the config.
"""

from absl import app, flags
from ml_collections import config_flags

from jaxpar.parallel.pipeline.checks import peak_in_flight, validate
from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES, schedule_kind
from jaxpar.parallel.pipeline.table import bubble_fraction, render

_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", SCHEDULE_NAMES, "Pipeline schedule.")
_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline ranks p.", lower_bound=1)
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "Microbatches m per step.", lower_bound=1)
_VIRTUAL = flags.DEFINE_integer(
    "virtual_stages", 1, "Virtual stages v per rank (interleaved_1f1b only).", lower_bound=1
)
_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file: also print the stage split.")
_SPLIT = flags.DEFINE_string("stage_layers", "auto", "Layers per stage ('auto' or a comma-separated list).")
_VOCAB = flags.DEFINE_enum("vocab", "spread", ("spread", "ends"), "Where embedding / LM head run.")


def main(argv):
    del argv
    kind, p, m, v = schedule_kind(_SCHEDULE.value), _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value
    try:
        schedule = kind.table(p, m, v)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    validate(schedule)
    print(render(schedule))
    print()
    print(f"bubble (table, lockstep costs): {bubble_fraction(schedule):.4f}")
    print(f"bubble (theory):                {kind.bubble(p, m, v):.4f}")
    unit = "microbatches" if v == 1 else "(microbatch, virtual stage) stashes"
    print(f"peak in-flight {unit} per rank: {peak_in_flight(schedule)}")
    if _CONFIG.value is None:
        return
    from jaxpar.models import facts
    from jaxpar.parallel.pipeline import balance

    config = _CONFIG.value
    split = balance.parse_split(_SPLIT.value)
    if split == balance.AUTO:
        split = balance.auto_split(facts(config.model), config.train.seq_len, schedule, placement=_VOCAB.value)
    elif problems := balance.split_problems(split, config.model.num_hidden_layers, p, v):
        raise app.UsageError(f"--stage_layers={_SPLIT.value}: " + "; ".join(problems))
    print()
    print("\n".join(balance.split_report(facts(config.model), config.train.seq_len, schedule, split, _VOCAB.value)))


if __name__ == "__main__":
    app.run(main)
