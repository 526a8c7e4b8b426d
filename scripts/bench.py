"""Time training steps on the shared bench config, optionally beside the HF + PyTorch peer.

  python scripts/bench.py [--model=llama|mixtral] [--steps=6] [--peer]

Warm-up (compile + one step) is excluded; the last line is
`step_s=<median> tokens_per_sec=<x> gflops_per_sec=<y>`.
"""

import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_enum("model", "llama", ["llama", "mixtral"], "Which bench config.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps after warm-up.")
_PEER = flags.DEFINE_bool("peer", False, "Also run ../shared/peers/hf_torch_bench.py on the same config.")
_THREADS = flags.DEFINE_integer("threads", 2, "CPU threads for the peer (torch.set_num_threads).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(os.path.dirname(ROOT), "shared", "peers", "hf_torch_bench.py")


def load_config(model: str):
    import importlib.util

    path = os.path.join(ROOT, "configs", f"bench_{model}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{model}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def run_peer(model: str, steps: int, threads: int) -> str:
    if not os.path.exists(PEER):
        return f"peer: {PEER} not found"
    cmd = [sys.executable, PEER, "--model", model, "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = (done.stdout or done.stderr).strip().splitlines()
    return "peer (HF transformers + PyTorch): " + (lines[-1] if lines else f"exit {done.returncode}")


def main(argv):
    del argv
    import jax
    import numpy as np

    from jaxpar import preflight
    from jaxpar.flops import train_flops_per_step
    from jaxpar.train.setup import build

    config = load_config(_MODEL.value)
    devices = jax.devices()[:1]
    preflight.check(config, len(devices))
    program = build(config, devices)
    batch_size, seq = config.train.global_batch_size, config.train.seq_len
    rng = np.random.default_rng(0)
    batch = jax.device_put(
        rng.integers(0, config.model.vocab_size, (batch_size, seq + 1)).astype(np.int32), program.batch_sharding
    )
    state = program.init()
    start = time.perf_counter()
    state, metrics = program.step(state, batch)
    jax.block_until_ready(metrics)
    print(f"model={_MODEL.value} device={devices[0].device_kind} compile+first step {time.perf_counter() - start:.1f}s")
    times = []
    for _ in range(_STEPS.value):
        start = time.perf_counter()
        state, metrics = program.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    if _PEER.value:
        print(run_peer(_MODEL.value, _STEPS.value, _THREADS.value))
    step_s = statistics.median(times)
    flops = train_flops_per_step(config.model, batch_size, seq)
    print(f"jaxpar: loss_last={float(metrics['loss']):.3f}")
    print(f"step_s={step_s:.4f} tokens_per_sec={batch_size * seq / step_s:.0f} gflops_per_sec={flops / step_s / 1e9:.1f}")


if __name__ == "__main__":
    app.run(main)
