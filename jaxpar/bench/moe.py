"""`scripts/bench.py moe`: fine-grained experts against a dense model of the same active FLOPs, side by
side on one device.

A Qwen3-MoE-shaped model (many small experts, top-k, dropless, no aux-loss coefficients; `--shape
deepseek_v3`: DeepSeek-V3's routed layer and MLA instead) and a Qwen3 of the same shape whose dense
MLP has as many hidden units as give it the MoE model's active parameters (for Qwen3-MoE's shape
k·F + E/3: the routed experts' FLOPs plus the router's), compiled once each; then `repeats` blocks of
`steps` timed steps alternate between the two (they compete for the same cores, so they never run at
once). Model FLOP/s: `ModelFacts.model_flops_per_step` (6·N_active·T + causal attention) over the
median step time; and per CPU-second of this process (all its threads), which stays meaningful on a
machine shared with other jobs. The last line is
`moe_gflops=<x> dense_gflops=<y> ratio=<x / y> cpu_ratio=<the same per CPU-second>`.

`a2a_shares`: for each expert count, the MoE model on data 2 x expert 4 (8 devices, top-k min(k, E)),
two profiled steps, and the all-to-all's share of the per-device op time from the profile breakdown
(`jaxpar.analysis.program.profile`).
"""

from __future__ import annotations

import os
import statistics

import jax

from jaxpar.axes import DATA, EXPERT, MESH_AXES
from jaxpar.models import facts
from jaxpar.train import harness

SHAPE = dict(
    vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    rope_theta=1e6, max_position_embeddings=1024,
)


def _config(model):
    from jaxpar.config import base_config

    c = base_config()
    c.model = model
    c.mesh.data = 1
    c.train.update(global_batch_size=8, seq_len=256, learning_rate=1e-3, warmup_steps=0, weight_decay=0.01)
    return c


def _qwen3_moe(experts: int, top_k: int, expert_ffn: int):
    from jaxpar.models import qwen3_moe

    return qwen3_moe.model_config(
        **SHAPE, intermediate_size=top_k * expert_ffn, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=expert_ffn, norm_topk_prob=True, router_aux_loss_coef=0.0,
    )


def _deepseek_v3(experts: int, top_k: int, expert_ffn: int):
    """DeepSeek-V3's routed layer at the bench's width: sigmoid scores, 8 groups of which each token
    keeps 4 (fewer when there are fewer experts), one shared expert of `expert_ffn`; MLA with 8 heads
    of 32 + 32 (q, k) and 64 (v), a 256 query and a 128 key / value latent; every layer routed."""
    from jaxpar.models import deepseek_v3

    shape = {k: v for k, v in SHAPE.items() if k not in ("head_dim", "num_key_value_heads")}
    groups = 8 if experts % 8 == 0 and experts // 8 * 4 >= top_k else 1
    return deepseek_v3.model_config(
        **shape, num_key_value_heads=SHAPE["num_attention_heads"], intermediate_size=top_k * expert_ffn,
        q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
        first_k_dense_replace=0, n_routed_experts=experts, n_shared_experts=1, moe_intermediate_size=expert_ffn,
        num_experts_per_tok=top_k, n_group=groups, topk_group=max(groups // 2, 1), routed_scaling_factor=2.5,
    )


# The MoE model shapes `scripts/bench.py moe --shape` names.
SHAPES = {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def configs(experts: int, top_k: int, expert_ffn: int, shape: str = "qwen3_moe"):
    """(the MoE config, the dense Qwen3 of the same active FLOPs), one device, batch 8 x 256. The dense
    MLP has as many hidden units as make its active parameters the MoE model's (for Qwen3-MoE's
    shape k·F + E/3: the routed experts' FLOPs plus the router's)."""
    from jaxpar.models import qwen3

    moe = _config(SHAPES[shape](experts, top_k, expert_ffn))
    # The dense model's active parameters grow by 3·D·L per MLP unit.
    base = facts(qwen3.model_config(**SHAPE, intermediate_size=1)).params_active
    units = 1 + round((facts(moe.model).params_active - base) / (3 * SHAPE["hidden_size"] * SHAPE["num_hidden_layers"]))
    dense = _config(qwen3.model_config(**SHAPE, intermediate_size=units))
    return moe, dense


def side_by_side(moe, dense, steps: int, repeats: int) -> tuple[dict, dict]:
    """({name: model GFLOP/s}, {name: model GFLOP per CPU-second}) for "moe" and "dense"."""
    runs, flops, times, cpu = {}, {}, {"moe": [], "dense": []}, {"moe": [], "dense": []}
    for name, config in (("moe", moe), ("dense", dense)):
        run = harness.prepare(config, jax.devices()[:1])
        compile_s = run.compile()
        _, first = run.step()
        runs[name] = run
        flops[name] = facts(config.model).model_flops_per_step(config.train.global_batch_size, config.train.seq_len)
        print(f"{name}: {flops[name] / 1e9:.3f} model GFLOP per step, compile + first step {compile_s + first:.1f} s", flush=True)
    for repeat in range(repeats):
        for name, run in runs.items():
            (_, block), _, cpu_s = harness.timed(run.steps, steps)
            cpu[name].append(cpu_s / steps)
            times[name].append(statistics.median(block))
            print(f"[{repeat + 1}] {name}: step {times[name][-1]:.3f} s ({cpu[name][-1]:.2f} CPU-s), "
                  f"{flops[name] / times[name][-1] / 1e9:.1f} GFLOP/s", flush=True)
    rate = {name: flops[name] / statistics.median(t) / 1e9 for name, t in times.items()}
    cpu_rate = {name: flops[name] / statistics.median(t) / 1e9 for name, t in cpu.items()}
    return rate, cpu_rate


def a2a_shares(experts_list: list[int], top_k: int, expert_ffn: int, folder: str) -> list[str]:
    """A line per expert count: op time per device per step, the all-to-all's and the experts' shares;
    each profile written under `folder`/E<count>."""
    from jaxpar.analysis.program import profile
    from jaxpar.train.observe import STEP_ANNOTATION, save_step_hlo

    lines = []
    for experts in experts_list:
        config, _ = configs(experts, min(top_k, experts), expert_ffn)
        config.mesh.update({axis: {DATA: 2, EXPERT: 4}.get(axis, 1) for axis in MESH_AXES})
        run = harness.prepare(config, jax.devices()[:8])
        run.compile()
        run.step()
        where = os.path.join(folder, f"E{experts}")
        jax.profiler.start_trace(where)
        for number in (1, 2):
            with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=number):
                run.step()
        jax.profiler.stop_trace()
        save_step_hlo(where, run.executable)
        scopes, collectives, total = profile.breakdown(profile.load(where))
        a2a = sum(r.ns for r in collectives if r.name == "all-to-all")
        experts_ns = sum(r.ns for r in scopes if r.name == "moe_experts")
        lines.append(f"E={experts} top-{min(top_k, experts)}: op time {total / 1e6:.0f} ms per device per step, "
                     f"all-to-all {100 * a2a / total:.1f}%, experts {100 * experts_ns / total:.1f}%")
        print(lines[-1], flush=True)
    return lines


def bench(experts: int, top_k: int, expert_ffn: int, steps: int, repeats: int, a2a: list[int], a2a_dir: str,
          shape: str = "qwen3_moe") -> None:
    moe, dense = configs(experts, top_k, expert_ffn, shape)
    rate, cpu_rate = side_by_side(moe, dense, steps, repeats)
    if a2a:
        a2a_shares(a2a, top_k, expert_ffn, a2a_dir)
    print(f"per CPU-second: moe {cpu_rate['moe']:.1f} GFLOP, dense {cpu_rate['dense']:.1f} GFLOP")
    print(f"moe_gflops={rate['moe']:.1f} dense_gflops={rate['dense']:.1f} ratio={rate['moe'] / rate['dense']:.2f} "
          f"cpu_ratio={cpu_rate['moe'] / cpu_rate['dense']:.2f}")
