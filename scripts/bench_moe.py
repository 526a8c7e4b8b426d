"""Fine-grained experts against a dense model of the same active FLOPs, side by side on CPU.

  python scripts/bench_moe.py [--experts=64] [--top_k=8] [--expert_ffn=128] [--steps=4] [--repeats=3]
      [--a2a_experts=8,32,128 --a2a_dir=DIR]

A Qwen3-MoE-shaped model (many small experts, top-k, dropless, no aux-loss coefficients) and a
Qwen3 of the same shape whose dense MLP has k·F + E/3 hidden units (the routed experts' FLOPs plus
the router's), both on one device, compiled once each; then `repeats` blocks of `steps` timed
steps alternate between the two (they compete for the same cores, so they never run at once).
Model FLOP/s: `ModelFacts.model_flops_per_step` (6·N_active·T + causal attention) over the
median step time; and per CPU-second of this process (`time.process_time`, all its threads), which
stays meaningful on a machine shared with other jobs, where wall times swing with their load. The
last line is `moe_gflops=<x> dense_gflops=<y> ratio=<x / y> cpu_ratio=<the same per CPU-second>`.

--a2a_experts: for each expert count, the MoE model on 8 emulated devices (data 2 x expert 4,
top-k min(k, E)), two profiled steps, and the all-to-all's share of the per-device op time from
the profile breakdown (`jaxpar.analysis.program.profile`), written under DIR/E<count>.
"""

import os
import statistics
import sys
import time

from absl import app, flags

_EXPERTS = flags.DEFINE_integer("experts", 64, "Routed experts.")
_TOP_K = flags.DEFINE_integer("top_k", 8, "Experts per token.")
_EXPERT_FFN = flags.DEFINE_integer("expert_ffn", 128, "Hidden size of one expert.")
_STEPS = flags.DEFINE_integer("steps", 4, "Timed steps per block.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating blocks per model.")
_A2A = flags.DEFINE_list("a2a_experts", [], "Expert counts to profile on data 2 x expert 4.")
_A2A_DIR = flags.DEFINE_string("a2a_dir", "/tmp/bench_moe_profiles", "Where the a2a profiles go.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(
    vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    rope_theta=1e6, max_position_embeddings=1024,
)


def configs(experts: int, top_k: int, expert_ffn: int):
    from jaxpar.config import base_config
    from jaxpar.models import qwen3, qwen3_moe

    def config(model):
        c = base_config()
        c.model = model
        c.mesh.data = 1
        c.train.update(global_batch_size=8, seq_len=256, learning_rate=1e-3, warmup_steps=0, weight_decay=0.01)
        return c

    moe = config(qwen3_moe.model_config(
        **SHAPE, intermediate_size=top_k * expert_ffn, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=expert_ffn, norm_topk_prob=True, router_aux_loss_coef=0.0,
    ))
    dense = config(qwen3.model_config(**SHAPE, intermediate_size=top_k * expert_ffn + round(experts / 3)))
    return moe, dense


def side_by_side(moe, dense):
    import jax

    from jaxpar.models import facts
    from jaxpar.train import harness

    runs, flops, times = {}, {}, {"moe": [], "dense": []}
    for name, config in (("moe", moe), ("dense", dense)):
        run = harness.prepare(config, jax.devices()[:1])
        compile_s = run.compile()
        _, first = run.step()
        runs[name] = run
        flops[name] = facts(config.model).model_flops_per_step(config.train.global_batch_size, config.train.seq_len)
        print(f"{name}: {flops[name] / 1e9:.1f} model GFLOP per step, compile + first step {compile_s + first:.1f} s", flush=True)
    cpu = {"moe": [], "dense": []}
    for repeat in range(_REPEATS.value):
        for name, run in runs.items():
            start = time.process_time()
            _, block = run.steps(_STEPS.value)
            cpu[name].append((time.process_time() - start) / _STEPS.value)
            times[name].append(statistics.median(block))
            print(f"[{repeat + 1}] {name}: step {times[name][-1]:.3f} s ({cpu[name][-1]:.2f} CPU-s), "
                  f"{flops[name] / times[name][-1] / 1e9:.1f} GFLOP/s", flush=True)
    rate = {name: flops[name] / statistics.median(t) / 1e9 for name, t in times.items()}
    cpu_rate = {name: flops[name] / statistics.median(t) / 1e9 for name, t in cpu.items()}
    return rate, cpu_rate


def a2a_shares(experts_list, top_k, expert_ffn):
    import jax

    from jaxpar.analysis.program import profile
    from jaxpar.train import harness
    from jaxpar.train.observe import STEP_ANNOTATION, save_step_hlo
    from tests.support.tiny import with_overrides

    lines = []
    for experts in experts_list:
        moe, _ = configs(experts, min(top_k, experts), expert_ffn)
        config = with_overrides(moe, {"data": 2, "expert": 4})
        run = harness.prepare(config, jax.devices()[:8])
        run.compile()
        run.step()
        folder = os.path.join(_A2A_DIR.value, f"E{experts}")
        jax.profiler.start_trace(folder)
        for number in (1, 2):
            with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=number):
                run.step()
        jax.profiler.stop_trace()
        save_step_hlo(folder, run.executable)
        scopes, collectives, total = profile.breakdown(profile.load(folder))
        a2a = sum(r.ns for r in collectives if r.name == "all-to-all")
        experts_ns = sum(r.ns for r in scopes if r.name == "moe_experts")
        lines.append(f"E={experts} top-{min(top_k, experts)}: op time {total / 1e6:.0f} ms per device per step, "
                     f"all-to-all {100 * a2a / total:.1f}%, experts {100 * experts_ns / total:.1f}%")
        print(lines[-1], flush=True)
    return lines


def main(argv):
    del argv
    if _A2A.value:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, ROOT)  # tests.support.tiny
    moe, dense = configs(_EXPERTS.value, _TOP_K.value, _EXPERT_FFN.value)
    rate, cpu_rate = side_by_side(moe, dense)
    if _A2A.value:
        a2a_shares([int(e) for e in _A2A.value], _TOP_K.value, _EXPERT_FFN.value)
    print(f"per CPU-second: moe {cpu_rate['moe']:.1f} GFLOP, dense {cpu_rate['dense']:.1f} GFLOP")
    print(f"moe_gflops={rate['moe']:.1f} dense_gflops={rate['dense']:.1f} ratio={rate['moe'] / rate['dense']:.2f} "
          f"cpu_ratio={cpu_rate['moe'] / cpu_rate['dense']:.2f}")


if __name__ == "__main__":
    app.run(main)
