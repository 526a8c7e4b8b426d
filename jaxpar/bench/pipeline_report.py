"""`scripts/pipeline.py report`: pipeline schedules compared on emulated CPU devices: bubble (table vs
theory), stash, compiled temp memory per device, bytes over `pipeline` per step from the compiled HLO
(the layer exchange into stage order, and the rest), measured train-step time, and the modelled
per-rank busy time; and the stage split each one runs (explicit or `auto`) with each stage's modelled
share of the cost.

Each schedule runs the same tiny Llama on a mesh of `stages` pipeline ranks x `data` replicas. On CPU
the emulated devices share the host's cores, so step time measures total work (including the
recomputing backward and idle ranks' zero sends), not the bubble a real accelerator would see; the
modelled busy time per rank (`balance.schedule_times`, lockstep) is what a device per rank would.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from jaxpar.train import harness


@dataclass(frozen=True)
class Report:
    stages: int = 4
    microbatches: int = 8
    virtual_stages: int = 2  # for interleaved_1f1b; zb_v and dualpipev take their own
    data: int = 2
    layers: int = 8
    hidden: int = 128
    seq_len: int = 64
    microbatch_rows: int = 2  # per data replica
    steps: int = 5
    stage_layers: str = "auto"
    vocab: str = "spread"
    vocab_size: int = 256
    schedules: tuple[str, ...] = ()  # () = every schedule
    baseline: bool = True


def make_config(r: Report, schedule: str | None, v: int):
    """The tiny Llama pipelined by `schedule` (None: the same global batch, all data parallel)."""
    from jaxpar.config import base_config
    from jaxpar.models.llama import model_config as llama_model_config

    p, m = r.stages, r.microbatches
    c = base_config()
    c.model = llama_model_config(
        vocab_size=r.vocab_size, hidden_size=r.hidden, intermediate_size=4 * r.hidden, num_hidden_layers=r.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=r.seq_len,
    )
    c.train.update(global_batch_size=r.microbatch_rows * m * r.data, seq_len=r.seq_len, warmup_steps=0)
    c.mesh.update(data=r.data, pipeline=p if schedule else 1, context=1, expert=1, tensor=1)
    if schedule:
        c.parallel.update(pipeline_schedule=schedule, num_microbatches=m, virtual_stages=v,
                          pipeline_stage_layers=r.stage_layers, pipeline_vocab=r.vocab)
    else:
        c.mesh.data = r.data * p
    return c


def measure(config, devices, steps: int):
    """(compiled temp bytes per device, bytes over `pipeline` per step {"layers", "step"}, median step
    seconds after one warm-up step)."""
    from jaxpar.analysis.program.compiled import pipeline_traffic

    run = harness.prepare(config, devices)
    run.compile()
    temp = run.executable.memory_analysis().temp_size_in_bytes
    traffic = pipeline_traffic(run.executable.as_text(), run.program.mesh)
    run.step()
    _, times = run.steps(steps)
    return temp, traffic, statistics.median(times)


HEADER = (f"{'schedule':<22}{'steps':>6}{'bubble':>8}{'theory':>8}{'stash':>7}{'buffers MiB':>13}"
          f"{'temp MiB/dev':>14}{'layers MiB':>12}{'pp MiB':>9}{'step ms':>10}{'busy':>7}")


def report(r: Report) -> None:
    """Prints the table (a row per schedule that accepts p, m, v; the baseline row) and each split."""
    import jax

    from jaxpar.models import facts
    from jaxpar.parallel.pipeline.balance import schedule_times, split_report, stage_costs
    from jaxpar.parallel.pipeline.checks import peak_in_flight
    from jaxpar.parallel.pipeline.options import pipeline_options
    from jaxpar.parallel.pipeline.schedules import SCHEDULES, bubble_fraction, theoretical_bubble
    from jaxpar.parallel.pipeline.slots import slot_plan_for

    p, m = r.stages, r.microbatches
    devices = jax.devices()[: p * r.data]
    print(f"p={p} m={m} (v={r.virtual_stages} for interleaved_1f1b, 2 for zb_v and dualpipev), data={r.data}; "
          f"Llama {r.layers} layers, hidden {r.hidden}, seq {r.seq_len}, {r.microbatch_rows} rows per microbatch per replica; "
          f"{len(devices)} emulated CPU devices on the host's cores")
    print(HEADER)
    print("-" * len(HEADER))
    configs = {}
    for kind in SCHEDULES:
        name = kind.name
        if r.schedules and name not in r.schedules:
            continue
        v = r.virtual_stages if kind.virtual_stages is None else kind.virtual_stages[0]
        if problems := kind.problems(p, m, v):
            print(f"{name:<22}skipped: {problems[0]}")
            continue
        plan = slot_plan_for(name, p, m, v)
        config = configs[name] = make_config(r, name, v)
        temp, traffic, seconds = measure(config, devices, r.steps)
        split = pipeline_options(config, dict(config.mesh), facts(config.model)).stage_layers
        costs = stage_costs(facts(config.model), r.seq_len, split, p, split_backward=kind.split_backward, placement=r.vocab)
        busy, total = schedule_times(plan.schedule, costs)
        # The engine's activation buffers per device: both slot arrays plus the two in-flight ones.
        buffers = (plan.act_slots + plan.grad_slots + 4) * r.microbatch_rows * r.seq_len * r.hidden * 4
        print(
            f"{name + (f' v={v}' if v > 1 else ''):<22}{plan.schedule.num_steps:>6}"
            f"{bubble_fraction(plan.schedule):>8.3f}{theoretical_bubble(name, p, m, v):>8.3f}"
            f"{max(peak_in_flight(plan.schedule)):>7}{buffers / 2**20:>13.2f}{temp / 2**20:>14.2f}"
            f"{traffic['layers'] / 2**20:>12.2f}{traffic['step'] / 2**20:>9.2f}{seconds * 1e3:>10.1f}"
            f"{sum(busy) / (p * total):>7.3f}",
            flush=True,
        )
    if r.baseline:
        temp, _, seconds = measure(make_config(r, None, 1), devices, r.steps)
        print(f"{'no pipeline':<22}{'':>6}{'':>8}{'':>8}{'':>7}{'':>13}{temp / 2**20:>14.2f}{'':>12}{'':>9}{seconds * 1e3:>10.1f}"
              f"   (data={r.data * p}, same global batch)")
    print("stash: most (microbatch, stage) inputs a rank holds (peak in flight); buffers: the engine's stash + mailbox arrays")
    print("per device; layers / pp MiB: bytes over pipeline per step per device, the layer exchange into stage order / the")
    print("rest (compiled HLO); busy: modelled mean busy time per rank over the step time (lockstep, analytic FLOPs)")
    print()
    for name, config in configs.items():
        plan = slot_plan_for(name, p, m, config.parallel.virtual_stages)
        split = pipeline_options(config, dict(config.mesh), facts(config.model)).stage_layers
        print(f"{name}: " + "\n  ".join(split_report(facts(config.model), config.train.seq_len, plan.schedule, split, r.vocab)))
