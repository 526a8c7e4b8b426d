"""Equal vs cost-balanced pipeline stages on a model whose vocab matters: the modelled per-rank
busy time of the schedule table, and the measured train-step time on emulated CPU devices.

    python scripts/pipeline_balance.py [--stages=2 --microbatches=4 --layers=8 --vocab_size=32000]

Rows: both vocab placements ("ends": embedding on the first stage, LM head + loss on the last, as
in the source article; "spread": vocab-parallel over the ranks, the default), each with the equal
split and the `auto` split for that placement (and "spread" also with the split that balances
"ends"). On CPU the emulated devices share the host's cores, so a measured step is closer to the
total work of all ranks than to the slowest rank's: see the README's pipeline section.
"""

import os
import statistics
import time

from absl import app, flags

_STAGES = flags.DEFINE_integer("stages", 2, "Pipeline ranks p (one emulated device each).")
_MICRO = flags.DEFINE_integer("microbatches", 4, "Microbatches m per step.")
_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", ("gpipe", "1f1b"), "Pipeline schedule (full backward).")
_LAYERS = flags.DEFINE_integer("layers", 8, "Decoder layers.")
_VOCAB = flags.DEFINE_integer("vocab_size", 32000, "Vocab size.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden size.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Sequence length.")
_ROWS = flags.DEFINE_integer("microbatch_rows", 2, "Rows per microbatch.")
_ONE_THREAD = flags.DEFINE_bool(
    "one_thread_per_device", False, "XLA:CPU without intra-op threads: each emulated device runs on one thread."
)
_STEPS = flags.DEFINE_integer("steps", 9, "Timed steps per row after two warm-up steps (median reported).")


def make_config(split, vocab: str):
    from jaxpar.config import base_config
    from jaxpar.models.llama import model_config as llama_model_config

    c = base_config()
    c.model = llama_model_config(
        vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value, intermediate_size=4 * _HIDDEN.value,
        num_hidden_layers=_LAYERS.value, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=_SEQ.value,
    )
    c.train.update(global_batch_size=_ROWS.value * _MICRO.value, seq_len=_SEQ.value, warmup_steps=0)
    c.mesh.update(data=1, pipeline=_STAGES.value, context=1, expert=1, tensor=1)
    c.parallel.update(pipeline_schedule=_SCHEDULE.value, num_microbatches=_MICRO.value, pipeline_vocab=vocab,
                      pipeline_stage_layers=list(split))
    return c


def prepare(config, devices):
    """The checked, built train step (`jaxpar.train.harness`), compiled and run twice."""
    from jaxpar.train import harness

    run = harness.prepare(config, devices)
    run.steps(2)
    return run


def _median_time(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_action_costs(config, p: int) -> dict:
    """Seconds, on one device, of the engine's pieces for one microbatch: one layer's F (forward)
    and B (recompute + backward), and the head + loss forward + backward over the whole vocab
    ("ends") and over V/p columns ("spread")."""
    import jax
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
    rows, seq = _ROWS.value, _SEQ.value
    x = jax.random.normal(jax.random.key(0), (rows, seq, cfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(seq), (rows, seq))
    targets = jnp.zeros((rows, seq), jnp.int32)
    forward = jax.jit(lambda lp, x: stage.forward(lp, shared, x, positions)[0])
    backward = jax.jit(lambda lp, x, g: stage.backward(BackBranch(True, True), lp, shared, x, positions, g, {}))
    costs = {"F": _median_time(forward, one_layer, x), "B": _median_time(backward, one_layer, x, x)}
    vocab = models.padded_vocab_size(cfg.vocab_size)
    for name, cols in (("ends", vocab), ("spread", vocab // p)):
        head = shared["lm_head"]["weight"][:, :cols]

        def loss(h, w):
            return mean_cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets)

        costs[name] = _median_time(jax.jit(jax.grad(loss, argnums=(0, 1))), x, head)
    return costs


def time_round_robin(prepared: list, steps: int) -> list[float]:
    """Median step time of each prepared step, timed in turns (A B C D A B C D ...) so that load
    from other processes drifting over the run hits every row alike."""
    times = [[] for _ in prepared]
    for _ in range(steps):
        for i, run in enumerate(prepared):
            times[i].append(run.step()[1])
    return [statistics.median(t) for t in times]


def main(argv):
    del argv
    if _ONE_THREAD.value:  # before jax starts its backends
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    import jax

    jax.config.update("jax_num_cpu_devices", _STAGES.value)
    from jaxpar.models import facts
    from jaxpar.parallel.pipeline import balance
    from jaxpar.parallel.pipeline.schedules import make_schedule

    p, m = _STAGES.value, _MICRO.value
    schedule = make_schedule(_SCHEDULE.value, p, m)
    model = facts(make_config((1,) * p, "spread").model)
    equal = balance.auto_split(model, _SEQ.value, _SCHEDULE.value, p, m, placement="spread")
    ends_auto = balance.auto_split(model, _SEQ.value, _SCHEDULE.value, p, m, placement="ends")
    rows = [("ends", "equal", equal), ("ends", "auto", ends_auto), ("spread", "equal = auto", equal),
            ("spread", "ends' auto", ends_auto)]
    tokens = _ROWS.value * m * _SEQ.value
    print(f"Llama {_LAYERS.value} layers, hidden {_HIDDEN.value}, vocab {_VOCAB.value}, seq {_SEQ.value}; "
          f"{_SCHEDULE.value} p={p} m={m}, {_ROWS.value} rows per microbatch; {p} emulated CPU devices")
    print(f"layer forward {model.layer_flops(_SEQ.value) / 1e6:.1f} MFLOP/token, "
          f"vocab work {model.vocab_flops() / 1e6:.1f} MFLOP/token")
    timed = measured_action_costs(make_config(equal, "spread"), p)
    print("measured on one device, per microbatch: layer F {F:.1f} ms, layer B {B:.1f} ms, head + loss fwd+bwd "
          "{ends:.1f} ms (whole vocab), {spread:.1f} ms (1/p of it)".format(**{k: 1e3 * v for k, v in timed.items()}))
    head = (f"{'vocab':<8}{'split':<14}{'layers':<14}{'modelled busy/step per rank':<30}{'FLOP model':>11}"
            f"{'timed model ms':>16}{'step ms':>9}{'tok/s':>8}")
    print(head)
    print("-" * len(head))
    devices = jax.devices()[:p]
    prepared = [prepare(make_config(split, vocab), devices) for vocab, _, split in rows]
    seconds = time_round_robin(prepared, _STEPS.value)
    reference = None
    for (vocab, label, split), measured in zip(rows, seconds):
        costs = balance.stage_costs(model, _SEQ.value, split, p, split_backward=schedule.split_backward, placement=vocab)
        busy, total = balance.schedule_times(schedule, costs)
        reference = reference or total  # modelled step time in units of the first row's (ends, equal)
        busy_text = ", ".join(f"{b / total:.2f}" for b in busy)
        # The same lockstep model with the actions' measured one-device times instead of FLOPs.
        f, b = timed["F"], timed["B"]
        head_time = timed[vocab]
        forward = [n * f for n in split]
        if vocab == "ends":
            forward[-1] += head_time
        seconds_costs = balance.StageCosts(tuple(forward), tuple(n * b for n in split), (0.0,) * len(split),
                                           head_time if vocab == "spread" else 0.0)
        timed_step = balance.schedule_times(schedule, seconds_costs)[1]
        print(f"{vocab:<8}{label:<14}{str(list(split)):<14}{busy_text:<30}{total / reference:>11.3f}"
              f"{timed_step * 1e3:>16.1f}{measured * 1e3:>9.1f}{tokens / measured:>8.0f}")


if __name__ == "__main__":
    app.run(main)
