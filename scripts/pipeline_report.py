"""Compares pipeline schedules on emulated CPU devices: bubble (table vs theory), stash, compiled
temp memory per device, bytes over `pipeline` per step from the compiled HLO (the layer exchange
into stage order, and the rest), measured train-step time, and the modelled per-rank busy time;
and the stage split each one runs (explicit or `auto`) with each stage's modelled share of the cost.

    python scripts/pipeline_report.py [--stages=4 --microbatches=8 --virtual_stages=2 --data=2]
        [--layers=7 --stage_layers=auto|2,2,2,1 --vocab=spread|ends] [--schedules=1f1b,zb_h1 --baseline=false]

Each schedule runs the same tiny Llama (`--layers`, `--hidden`, `--seq_len`, `--microbatch_rows`
rows per microbatch) on a mesh of `--stages` pipeline ranks × `--data` replicas. On CPU the
emulated devices share the host's cores, so step time measures total work (including the
recomputing backward and idle ranks' zero sends), not the bubble a real accelerator would see;
the modelled busy time per rank (`balance.schedule_times`, lockstep) is what a device per rank would.
Every schedule runs unless `--schedules` names some (zb_v and dualpipev at v = 2; dualpipev needs
m >= 2p), then the same global batch without a pipeline unless `--baseline=false`.
"""

import statistics

from absl import app, flags

_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline ranks p.")
_MICRO = flags.DEFINE_integer("microbatches", 8, "Microbatches m per step.")
_VIRTUAL = flags.DEFINE_integer("virtual_stages", 2, "v for interleaved_1f1b (zb_v and dualpipev take 2).")
_DATA = flags.DEFINE_integer("data", 2, "Data-parallel replicas beside the pipeline.")
_LAYERS = flags.DEFINE_integer("layers", 8, "Decoder layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 128, "Hidden size.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "Sequence length.")
_ROWS = flags.DEFINE_integer("microbatch_rows", 2, "Rows per microbatch per data replica.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps after one warm-up step.")
_SPLIT = flags.DEFINE_string("stage_layers", "auto", "parallel.pipeline_stage_layers ('auto' or a list per stage).")
_VOCAB_AT = flags.DEFINE_enum("vocab", "spread", ("spread", "ends"), "parallel.pipeline_vocab.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 256, "Vocab size.")
_SCHEDULES = flags.DEFINE_list("schedules", [], "Schedules to run (default: every one).")
_BASELINE = flags.DEFINE_bool("baseline", True, "Also run the same global batch without a pipeline.")


def make_config(schedule: str | None, p: int, m: int, v: int):
    from jaxpar.config import base_config
    from jaxpar.models.llama import model_config as llama_model_config

    c = base_config()
    c.model = llama_model_config(
        vocab_size=_VOCAB_SIZE.value, hidden_size=_HIDDEN.value, intermediate_size=4 * _HIDDEN.value,
        num_hidden_layers=_LAYERS.value, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=_SEQ.value,
    )
    c.train.update(global_batch_size=_ROWS.value * m * _DATA.value, seq_len=_SEQ.value, warmup_steps=0)
    c.mesh.update(data=_DATA.value, pipeline=p if schedule else 1, context=1, expert=1, tensor=1)
    if schedule:
        c.parallel.update(pipeline_schedule=schedule, num_microbatches=m, virtual_stages=v,
                          pipeline_stage_layers=_SPLIT.value, pipeline_vocab=_VOCAB_AT.value)
    else:  # the same global batch on the same devices, all data parallel
        c.mesh.data = _DATA.value * p
    return c


def measure(config, devices):
    """(compiled temp bytes per device, bytes over `pipeline` per step {"layers", "step"}, median
    step seconds after one warm-up step)."""
    from jaxpar.analysis.program.compiled import pipeline_traffic
    from jaxpar.train import harness

    run = harness.prepare(config, devices)
    run.compile()
    temp = run.executable.memory_analysis().temp_size_in_bytes
    traffic = pipeline_traffic(run.executable.as_text(), run.program.mesh)
    run.step()
    _, times = run.steps(_STEPS.value)
    return temp, traffic, statistics.median(times)


def main(argv):
    del argv
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from jaxpar.models import facts
    from jaxpar.parallel.pipeline.balance import schedule_times, split_report, stage_costs
    from jaxpar.parallel.pipeline.checks import peak_in_flight
    from jaxpar.parallel.pipeline.options import pipeline_options
    from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES, SCHEDULES, bubble_fraction, theoretical_bubble
    from jaxpar.parallel.pipeline.slots import slot_plan_for

    if unknown := [s for s in _SCHEDULES.value if s not in SCHEDULE_NAMES]:
        raise app.UsageError(f"--schedules: unknown {', '.join(unknown)}; valid: {', '.join(SCHEDULE_NAMES)}")
    p, m = _STAGES.value, _MICRO.value
    devices = jax.devices()[: p * _DATA.value]
    print(
        f"p={p} m={m} (v={_VIRTUAL.value} for interleaved_1f1b, 2 for zb_v and dualpipev), data={_DATA.value}; "
        f"Llama {_LAYERS.value} layers, "
        f"hidden {_HIDDEN.value}, seq {_SEQ.value}, {_ROWS.value} rows per microbatch per replica; "
        f"{len(devices)} emulated CPU devices on the host's cores"
    )
    header = (
        f"{'schedule':<22}{'steps':>6}{'bubble':>8}{'theory':>8}{'stash':>7}{'buffers MiB':>13}"
        f"{'temp MiB/dev':>14}{'layers MiB':>12}{'pp MiB':>9}{'step ms':>10}{'busy':>7}"
    )
    print(header)
    print("-" * len(header))
    splits = {}
    for kind in SCHEDULES:
        name = kind.name
        if _SCHEDULES.value and name not in _SCHEDULES.value:
            continue
        v = _VIRTUAL.value if kind.virtual_stages is None else kind.virtual_stages[0]
        if problems := kind.problems(p, m, v):
            print(f"{name:<22}skipped: {problems[0]}")
            continue
        plan = slot_plan_for(name, p, m, v)
        splits[name] = make_config(name, p, m, v)
        temp, traffic, seconds = measure(splits[name], devices)
        split = pipeline_options(splits[name], dict(splits[name].mesh), facts(splits[name].model)).stage_layers
        costs = stage_costs(facts(splits[name].model), _SEQ.value, split, p, split_backward=kind.split_backward,
                            placement=_VOCAB_AT.value)
        busy, total = schedule_times(plan.schedule, costs)
        # The engine's activation buffers per device: both slot arrays plus the two in-flight ones.
        buffers = (plan.act_slots + plan.grad_slots + 4) * _ROWS.value * _SEQ.value * _HIDDEN.value * 4
        print(
            f"{name + (f' v={v}' if v > 1 else ''):<22}{plan.schedule.num_steps:>6}"
            f"{bubble_fraction(plan.schedule):>8.3f}{theoretical_bubble(name, p, m, v):>8.3f}"
            f"{max(peak_in_flight(plan.schedule)):>7}{buffers / 2**20:>13.2f}{temp / 2**20:>14.2f}"
            f"{traffic['layers'] / 2**20:>12.2f}{traffic['step'] / 2**20:>9.2f}{seconds * 1e3:>10.1f}"
            f"{sum(busy) / (p * total):>7.3f}"
        )
    if _BASELINE.value:
        temp, _, seconds = measure(make_config(None, p, m, 1), devices)
        print(f"{'no pipeline':<22}{'':>6}{'':>8}{'':>8}{'':>7}{'':>13}{temp / 2**20:>14.2f}{'':>12}{'':>9}{seconds * 1e3:>10.1f}"
              f"   (data={_DATA.value * p}, same global batch)")
    print("stash: most (microbatch, stage) inputs a rank holds (peak in flight); buffers: the engine's stash + mailbox arrays")
    print("per device; layers / pp MiB: bytes over pipeline per step per device, the layer exchange into stage order / the")
    print("rest (compiled HLO); busy: modelled mean busy time per rank over the step time (lockstep, analytic FLOPs)")
    print()
    for name, config in splits.items():
        plan = slot_plan_for(name, p, m, config.parallel.virtual_stages)
        split = pipeline_options(config, dict(config.mesh), facts(config.model)).stage_layers
        print(f"{name}: " + "\n  ".join(split_report(facts(config.model), config.train.seq_len, plan.schedule, split, _VOCAB_AT.value)))


if __name__ == "__main__":
    app.run(main)
