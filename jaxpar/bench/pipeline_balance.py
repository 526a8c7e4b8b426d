"""`scripts/pipeline.py balance`: equal against cost-balanced pipeline stages on a model whose vocab
matters: the modelled per-rank busy time of the schedule table, the same lockstep model with the
engine's pieces timed on one device, and the measured train-step time on emulated CPU devices.

Rows: both vocab placements ("ends": embedding on the first stage, LM head + loss on the last, as in
the source article; "spread": vocab-parallel over the ranks, the default), each with the equal split
and the `auto` split for that placement (and "spread" also with the split that balances "ends"). On
CPU the emulated devices share the host's cores, so a measured step is closer to the total work of all
ranks than to the slowest rank's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax

from jaxpar.train import harness


@dataclass(frozen=True)
class Balance:
    stages: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"  # gpipe | 1f1b (full backward)
    layers: int = 8
    vocab_size: int = 32000
    hidden: int = 256
    seq_len: int = 128
    microbatch_rows: int = 2
    steps: int = 9  # timed steps per row, after two warm-up steps


def make_config(b: Balance, split, vocab: str):
    from jaxpar.config import base_config
    from jaxpar.models.llama import model_config as llama_model_config

    c = base_config()
    c.model = llama_model_config(
        vocab_size=b.vocab_size, hidden_size=b.hidden, intermediate_size=4 * b.hidden, num_hidden_layers=b.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=b.seq_len,
    )
    c.train.update(global_batch_size=b.microbatch_rows * b.microbatches, seq_len=b.seq_len, warmup_steps=0)
    c.mesh.update(data=1, pipeline=b.stages, context=1, expert=1, tensor=1)
    c.parallel.update(pipeline_schedule=b.schedule, num_microbatches=b.microbatches, pipeline_vocab=vocab,
                      pipeline_stage_layers=list(split))
    return c


def _median_time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_action_costs(b: Balance, config) -> dict:
    """Seconds, on one device, of the engine's pieces for one microbatch: one layer's F (forward) and B
    (recompute + backward), and the head + loss forward + backward over the whole vocab ("ends") and
    over V/p columns ("spread")."""
    import jax.numpy as jnp

    from jaxpar import models
    from jaxpar.models.options import RunOptions
    from jaxpar.parallel.pipeline.slots import BackBranch
    from jaxpar.parallel.pipeline.stage import Stage
    from jaxpar.parallel.tensor import mean_cross_entropy
    from jaxpar.train.step import stage_model

    cfg = config.model
    params = models.init_params(cfg, 0)
    one_layer = jax.tree.map(lambda a: a[:1], params["layers"])
    shared = {k: v for k, v in params.items() if k != "layers"}
    stage = Stage(stage_model(cfg), RunOptions())
    rows, seq = b.microbatch_rows, b.seq_len
    x = jax.random.normal(jax.random.key(0), (rows, seq, cfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(seq), (rows, seq))
    targets = jnp.zeros((rows, seq), jnp.int32)
    forward = jax.jit(lambda lp, x: stage.forward(lp, shared, x, positions)[0])
    backward = jax.jit(lambda lp, x, g: stage.backward(BackBranch(True, True), lp, shared, x, positions, g, {}))
    costs = {"F": _median_time(forward, one_layer, x), "B": _median_time(backward, one_layer, x, x)}
    vocab = models.padded_vocab_size(cfg.vocab_size)
    for name, cols in (("ends", vocab), ("spread", vocab // b.stages)):
        head = shared["lm_head"]["weight"][:, :cols]

        def loss(h, w):
            return mean_cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets)

        costs[name] = _median_time(jax.jit(jax.grad(loss, argnums=(0, 1))), x, head)
    return costs


def time_round_robin(prepared: list, steps: int) -> list[float]:
    """Median step time of each prepared step, timed in turns (A B C D A B C D ...) so that load from
    other processes drifting over the run hits every row alike."""
    times = [[] for _ in prepared]
    for _ in range(steps):
        for i, run in enumerate(prepared):
            times[i].append(run.step()[1])
    return [statistics.median(t) for t in times]


def rows(b: Balance) -> list[tuple[str, str, tuple]]:
    """(vocab placement, split label, split) per row."""
    from jaxpar.models import facts
    from jaxpar.parallel.pipeline import balance

    p, m = b.stages, b.microbatches
    model = facts(make_config(b, (1,) * p, "spread").model)
    equal = balance.auto_split(model, b.seq_len, b.schedule, p, m, placement="spread")
    ends_auto = balance.auto_split(model, b.seq_len, b.schedule, p, m, placement="ends")
    return [("ends", "equal", equal), ("ends", "auto", ends_auto), ("spread", "equal = auto", equal), ("spread", "ends' auto", ends_auto)]


def report(b: Balance) -> None:
    from jaxpar.models import facts
    from jaxpar.parallel.pipeline import balance
    from jaxpar.parallel.pipeline.schedules import make_schedule

    p, m = b.stages, b.microbatches
    schedule = make_schedule(b.schedule, p, m)
    table = rows(b)
    model = facts(make_config(b, table[0][2], "spread").model)
    tokens = b.microbatch_rows * m * b.seq_len
    print(f"Llama {b.layers} layers, hidden {b.hidden}, vocab {b.vocab_size}, seq {b.seq_len}; "
          f"{b.schedule} p={p} m={m}, {b.microbatch_rows} rows per microbatch; {p} emulated CPU devices")
    print(f"layer forward {model.layer_flops(b.seq_len) / 1e6:.1f} MFLOP/token, vocab work {model.vocab_flops() / 1e6:.1f} MFLOP/token")
    timed = measured_action_costs(b, make_config(b, table[0][2], "spread"))
    print("measured on one device, per microbatch: layer F {F:.1f} ms, layer B {B:.1f} ms, head + loss fwd+bwd "
          "{ends:.1f} ms (whole vocab), {spread:.1f} ms (1/p of it)".format(**{k: 1e3 * v for k, v in timed.items()}))
    head = (f"{'vocab':<8}{'split':<14}{'layers':<14}{'modelled busy/step per rank':<30}{'FLOP model':>11}"
            f"{'timed model ms':>16}{'step ms':>9}{'tok/s':>8}")
    print(head)
    print("-" * len(head), flush=True)
    devices = jax.devices()[:p]
    prepared = []
    for vocab, _, split in table:
        run = harness.prepare(make_config(b, split, vocab), devices)
        run.steps(2)  # compiled and warmed up
        prepared.append(run)
    seconds = time_round_robin(prepared, b.steps)
    reference = None
    for (vocab, label, split), measured in zip(table, seconds):
        costs = balance.stage_costs(model, b.seq_len, split, p, split_backward=schedule.split_backward, placement=vocab)
        busy, total = balance.schedule_times(schedule, costs)
        reference = reference or total  # modelled step time in units of the first row's (ends, equal)
        busy_text = ", ".join(f"{x / total:.2f}" for x in busy)
        # The same lockstep model with the actions' measured one-device times instead of FLOPs.
        head_time = timed[vocab]
        forward = [n * timed["F"] for n in split]
        if vocab == "ends":
            forward[-1] += head_time
        seconds_costs = balance.StageCosts(tuple(forward), tuple(n * timed["B"] for n in split), (0.0,) * len(split),
                                           head_time if vocab == "spread" else 0.0)
        timed_step = balance.schedule_times(schedule, seconds_costs)[1]
        print(f"{vocab:<8}{label:<14}{str(list(split)):<14}{busy_text:<30}{total / reference:>11.3f}"
              f"{timed_step * 1e3:>16.1f}{measured * 1e3:>9.1f}{tokens / measured:>8.0f}")
