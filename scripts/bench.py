"""Time training steps on the shared bench config, optionally beside the HF + PyTorch peer.

  python scripts/bench.py [--model=llama|mixtral] [--steps=6] [--peer] [--repeats=3]
      [--remat=full] [--profile=DIR]

Warm-up (compile + one step) is excluded. With --peer, blocks of `steps` jaxpar steps and runs of
../shared/peers/hf_torch_bench.py alternate `repeats` times in this one invocation (the two
compete for the same cores, so they never run at once), and the medians are compared.
--profile traces two more steps into DIR and prints the per-scope breakdown
(`scripts/profile_report.py DIR` prints it again). The last line is
`step_s=<median> tokens_per_sec=<x> gflops_per_sec=<y>`.
"""

import os
import statistics
import subprocess
import sys

from absl import app, flags

_MODEL = flags.DEFINE_enum("model", "llama", ["llama", "mixtral"], "Which bench config.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps after warm-up.")
_PEER = flags.DEFINE_bool("peer", False, "Also run ../shared/peers/hf_torch_bench.py on the same config.")
_THREADS = flags.DEFINE_integer("threads", 2, "CPU threads for the peer (torch.set_num_threads).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed blocks (each followed by a peer run with --peer).")
_REMAT = flags.DEFINE_string("remat", "", "Override parallel.remat (default: the config's).")
_PROFILE = flags.DEFINE_string("profile", "", "Trace two steps into this folder and print the breakdown.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(os.path.dirname(ROOT), "shared", "peers", "hf_torch_bench.py")


def load_config(model: str):
    import importlib.util

    path = os.path.join(ROOT, "configs", f"bench_{model}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{model}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def run_peer(model: str, steps: int, threads: int) -> tuple[str, float]:
    """(the peer's summary line, its tokens/s or nan)."""
    if not os.path.exists(PEER):
        return f"peer: {PEER} not found", float("nan")
    cmd = [sys.executable, PEER, "--model", model, "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = (done.stdout or done.stderr).strip().splitlines()
    line = lines[-1] if lines else f"exit {done.returncode}"
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    return line, float(fields.get("tokens_per_s", "nan"))


def roofline(flops: float, tokens: int, ours: float, peer: float | None, target: float = 1.5) -> str:
    """How far the step is from a lone matmul's speed on this host, and what `target`× the peer needs:
    the ceiling any fp32 step can reach here, whoever wrote it (model FLOPs, recompute not counted)."""
    from jaxpar.train.observe import measured_host_flops

    peak = measured_host_flops("float32")
    line = (f"roofline: one fp32 2048^3 matmul runs {peak / 1e9:.0f} GFLOP/s here; jaxpar's step does "
            f"{flops * ours / tokens / 1e9:.0f} GFLOP/s of model FLOPs ({flops * ours / tokens / peak:.0%} of it)")
    if peer:
        need = flops * peer * target / tokens
        line += f"; {target}x the peer would need {need / 1e9:.0f} GFLOP/s ({need / peak:.0%} of that matmul)"
    return line


def profile_steps(run, folder: str):
    """Two annotated steps under jax.profiler plus the step's HLO text, then the breakdown."""
    import jax

    from jaxpar.analysis.program import profile
    from jaxpar.train.observe import STEP_ANNOTATION, save_step_hlo

    jax.profiler.start_trace(folder)
    for number in (1, 2):
        with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=number):
            run.step()
    jax.profiler.stop_trace()
    save_step_hlo(folder, run.executable)
    print(profile.format_report(profile.load(folder)))


def main(argv):
    del argv
    import jax

    from jaxpar.models import facts
    from jaxpar.train import harness

    config = load_config(_MODEL.value)
    if _REMAT.value:
        config.parallel.remat = _REMAT.value
    devices = jax.devices()[:1]
    run = harness.prepare(config, devices)
    batch_size, seq = config.train.global_batch_size, config.train.seq_len
    compile_s = run.compile()
    metrics, first_s = run.step()
    print(
        f"model={_MODEL.value} remat={config.parallel.remat} device={devices[0].device_kind} "
        f"compile+first step {compile_s + first_s:.1f}s"
    )
    ours, peers = [], []
    for repeat in range(_REPEATS.value):
        metrics, times = run.steps(_STEPS.value)
        ours.append(statistics.median(times))
        line = f"[{repeat + 1}] jaxpar tokens/s {batch_size * seq / ours[-1]:.0f}"
        if _PEER.value:
            peer_line, peer_tokens = run_peer(_MODEL.value, _STEPS.value, _THREADS.value)
            peers.append(peer_tokens)
            line += f" | peer (HF transformers + PyTorch): {peer_line}"
        print(line, flush=True)
    if _PROFILE.value:
        profile_steps(run, _PROFILE.value)
    step_s = statistics.median(ours)
    tokens = [batch_size * seq / t for t in ours]
    print(f"jaxpar: loss_last={float(metrics['loss']):.3f} tokens/s median {statistics.median(tokens):.0f} "
          f"(min {min(tokens):.0f}, max {max(tokens):.0f}, {len(tokens)} blocks of {_STEPS.value} steps)")
    if peers:
        print(f"peer: tokens/s median {statistics.median(peers):.0f} (min {min(peers):.0f}, max {max(peers):.0f}); "
              f"jaxpar / peer = {statistics.median(tokens) / statistics.median(peers):.2f}x "
              f"(per repeat: {', '.join(f'{a / b:.2f}' for a, b in zip(tokens, peers))})")
    flops = facts(config.model).model_flops_per_step(batch_size, seq)
    if devices[0].platform == "cpu":
        print(roofline(flops, batch_size * seq, statistics.median(tokens), statistics.median(peers) if peers else None))
    print(f"step_s={step_s:.4f} tokens_per_sec={batch_size * seq / step_s:.0f} gflops_per_sec={flops / step_s / 1e9:.1f}")


if __name__ == "__main__":
    app.run(main)
