"""`scripts/bench.py step`: a config's train step on one device, timed in blocks, optionally beside
the transformers + PyTorch peer on the same model and batch; on CPU a roofline line; optionally a
profile of two more steps.

Warm-up (compile + one step) is excluded. With a peer, blocks of jaxpar steps and peer runs alternate
(the two compete for the same cores, so they never run at once) and the medians are compared. The
last line printed is `step_s=<median> tokens_per_sec=<x> gflops_per_sec=<y>`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable

import jax

from jaxpar.models import facts
from jaxpar.train import harness

Peer = Callable[[], tuple[str, float]]  # () -> (its summary line, its tokens/s or nan)


def write_peer_config(config, directory: str) -> str:
    """`directory`/config.json: the config's model as transformers reads it (the peer builds its model
    from this, so the two sides cannot drift apart). Returns `directory`."""
    from jaxpar.interop.hf import hf_config

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config.model), f, indent=2, sort_keys=True)
    return directory


def peer_line(command: list[str]) -> tuple[str, float]:
    """Runs a peer process; (its last stdout line, the tokens_per_s it names or nan)."""
    done = subprocess.run(command, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        why = (done.stderr.strip().splitlines() or [""])[-1]
        return f"peer failed (exit {done.returncode}): {why}", float("nan")
    fields = dict(word.split("=", 1) for word in lines[-1].split() if "=" in word)
    return lines[-1], float(fields.get("tokens_per_s", "nan"))


def roofline(flops: float, tokens: int, ours: float, peer: float | None, target: float = 1.5) -> str:
    """How far the step is from a lone matmul's speed on this host, and what `target`x the peer needs:
    the ceiling any fp32 step can reach here, whoever wrote it (model FLOPs, recompute not counted)."""
    from jaxpar.train.observe import measured_host_flops

    peak = measured_host_flops("float32")
    line = (f"roofline: one fp32 2048^3 matmul runs {peak / 1e9:.0f} GFLOP/s here; jaxpar's step does "
            f"{flops * ours / tokens / 1e9:.0f} GFLOP/s of model FLOPs ({flops * ours / tokens / peak:.0%} of it)")
    if peer:
        need = flops * peer * target / tokens
        line += f"; {target}x the peer would need {need / 1e9:.0f} GFLOP/s ({need / peak:.0%} of that matmul)"
    return line


def profile_steps(run: harness.Harness, folder: str) -> None:
    """Two annotated steps under jax.profiler plus the step's HLO text, then the per-scope breakdown
    (`scripts/profile_report.py FOLDER` prints it again)."""
    from jaxpar.analysis.program import profile
    from jaxpar.train.observe import STEP_ANNOTATION, save_step_hlo

    jax.profiler.start_trace(folder)
    for number in (1, 2):
        with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=number):
            run.step()
    jax.profiler.stop_trace()
    save_step_hlo(folder, run.executable)
    print(profile.format_report(profile.load(folder)))


def bench(config, label: str, steps: int, repeats: int, peer: Peer | None = None, profile: str = "") -> None:
    """Prints the warm-up, a line per block (and peer run), the medians, the roofline and the last line."""
    devices = jax.devices()[:1]
    run = harness.prepare(config, devices)
    batch_size, seq = config.train.global_batch_size, config.train.seq_len
    tokens_per_step = batch_size * seq
    compile_s = run.compile()
    metrics, first_s = run.step()
    print(f"model={label} remat={config.parallel.remat} device={devices[0].device_kind} "
          f"compile+first step {compile_s + first_s:.1f}s", flush=True)
    ours, peers = [], []
    for repeat in range(repeats):
        metrics, times = run.steps(steps)
        ours.append(statistics.median(times))
        line = f"[{repeat + 1}] jaxpar tokens/s {tokens_per_step / ours[-1]:.0f}"
        if peer is not None:
            peer_summary, peer_tokens = peer()
            peers.append(peer_tokens)
            line += f" | peer (HF transformers + PyTorch): {peer_summary}"
        print(line, flush=True)
    if profile:
        profile_steps(run, profile)
    step_s = statistics.median(ours)
    tokens = [tokens_per_step / t for t in ours]
    print(f"jaxpar: loss_last={float(metrics['loss']):.3f} tokens/s median {statistics.median(tokens):.0f} "
          f"(min {min(tokens):.0f}, max {max(tokens):.0f}, {len(tokens)} blocks of {steps} steps)")
    if peers:
        print(f"peer: tokens/s median {statistics.median(peers):.0f} (min {min(peers):.0f}, max {max(peers):.0f}); "
              f"jaxpar / peer = {statistics.median(tokens) / statistics.median(peers):.2f}x "
              f"(per repeat: {', '.join(f'{a / b:.2f}' for a, b in zip(tokens, peers))})")
    flops = facts(config.model).model_flops_per_step(batch_size, seq)
    if devices[0].platform == "cpu":
        print(roofline(flops, tokens_per_step, statistics.median(tokens), statistics.median(peers) if peers else None))
    print(f"step_s={step_s:.4f} tokens_per_sec={tokens_per_step / step_s:.0f} gflops_per_sec={flops / step_s / 1e9:.1f}")
