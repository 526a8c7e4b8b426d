"""The training loop: preflight, build, then step, log and report."""

from __future__ import annotations

import json
import os
import time

import jax
from tqdm.auto import tqdm

from jaxpar import preflight
from jaxpar.data import GlobalBatches, global_batch, load_tokens
from jaxpar.mesh import describe
from jaxpar.train.observe import Observer  # observe hook
from jaxpar.train.setup import build, bytes_per_device


# Metrics every step reports; anything else a model reports (MoE router stats) is logged as is.
STEP_METRICS = ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped_steps")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


def memory_report(program) -> str:
    abstract = jax.eval_shape(program.init)
    shard = program.state_shardings
    params = bytes_per_device(abstract.params, shard.params)
    opt = bytes_per_device(abstract.opt_state, shard.opt_state)
    return f"per device: params {_human(params)}, optimizer state {_human(opt)}"


def train(config, workdir: str, devices=None, progress: bool = True) -> list[dict]:
    """Trains for `config.train.steps` steps; returns the per-step metrics it also writes to
    `workdir/metrics.jsonl`."""
    devices = list(jax.devices() if devices is None else devices)
    preflight.check(config, len(devices))
    train_cfg = config.train
    batches = GlobalBatches(load_tokens(config.data), train_cfg.seq_len, train_cfg.global_batch_size, train_cfg.seed)
    program = build(config, devices)
    print(f"mesh: {describe(program.mesh)} on {len(devices)} {devices[0].platform} devices")
    print(memory_report(program))

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    state = program.init()
    observer = Observer(config, workdir, program)  # observe hook: timing, MFU, TensorBoard, profile
    history = []
    fp16 = train_cfg.compute_dtype == "float16"
    bar = tqdm(range(train_cfg.steps), disable=not progress or jax.process_index() != 0, desc="train")
    with observer, open(os.path.join(workdir, "metrics.jsonl"), "w") as log:  # observe hook: closes it
        for step in bar:
            batch = global_batch(batches, step, program.batch_sharding)
            with observer.step(step):  # observe hook: compile timing, profile window
                start = time.perf_counter()
                state, metrics = program.step(state, batch)
                metrics = jax.device_get(metrics)  # waits for the step, so the timing below is honest
                seconds = time.perf_counter() - start
            record = {
                "step": step + 1,
                "loss": float(metrics["loss"]),
                "grad_norm": float(metrics["grad_norm"]),
                "learning_rate": float(metrics["learning_rate"]),
                **observer.throughput(seconds),  # observe hook: step_s, tokens_per_sec, mfu, compile_s
            }
            if fp16:
                record["loss_scale"] = float(metrics["loss_scale"])
                record["skipped_steps"] = int(metrics["skipped_steps"])
            record.update({k: v.tolist() for k, v in metrics.items() if k not in STEP_METRICS})
            history.append(record)
            observer.log(record)  # observe hook: TensorBoard scalars
            if jax.process_index() == 0:
                log.write(json.dumps(record) + "\n")
                log.flush()
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
    return history
