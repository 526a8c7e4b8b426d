"""MaxText's trainer on a tiny Llama, 8 emulated CPU devices, one mesh: the peer of `scripts/bench.py mesh --maxtext`.

    $MAXTEXT_PYTHON benchmarks/peers/maxtext/run_tiny.py --mesh=fsdp8 [--dtype=fp32] [--remat=full] [--steps=10]
        [KEY=VALUE ...]

Runs in MaxText's own environment (install.sh beside this file), never in jaxpar's: it imports MaxText's
pre-training entry point (`maxtext.trainers.pre_train.train.main`) and gives it MaxText's packaged
base.yml plus the overrides below, synthetic data (one fixed random batch), no checkpoints. KEY=VALUE
words are more MaxText overrides; `scripts/bench.py mesh` passes the model and batch keys derived from
`configs/maxtext_tiny.py` (`jaxpar.bench.mesh.maxtext_overrides`), which TINY_LLAMA below equals
(tests/scripts/test_peers.py holds them equal).

Measured, as jaxpar's side measures itself: the train step's compile time (the compile events
jax.monitoring reports for functions named *train_step*: trace, lower to MLIR, XLA compile), and the
median step time after --warmup steps, from the step times MaxText writes to its metrics file (host
wall time between step dispatches). MaxText's own log goes to OUT/LABEL.log. The last line printed is
`RESULT {json}` with ok, compile_train_step_s, median_step_s, tokens_per_s, first_loss, final_loss.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

# The model and batch of configs/maxtext_tiny.py, in MaxText's key names (base.yml).
TINY_LLAMA = {
    "base_emb_dim": "256",
    "base_num_query_heads": "4",
    "base_num_kv_heads": "2",
    "head_dim": "64",
    "base_mlp_dim": "688",
    "base_num_decoder_layers": "4",
    "vocab_size": "256",
    "max_target_length": "256",
    "per_device_batch_size": "1",
    "learning_rate": "0.001",
}
# What makes this a CPU benchmark rather than a training job: no checkpoints, no goodput or TensorBoard
# recorders, synthetic data, plain dot-product attention, Llama-2 decoder blocks.
SETTINGS = {
    "hardware": "cpu",
    "skip_jax_distributed_system": "true",
    "decoder_block": "llama2",
    "dataset_type": "synthetic",
    "enable_checkpointing": "false",
    "attention": "dot_product",
    "enable_goodput_recording": "false",
    "monitor_goodput": "false",
    "enable_tensorboard": "false",
    "log_period": "100000",
}
# jaxpar's mesh names (jaxpar.bench.mesh.MESHES) as MaxText's ICI parallelism keys; fsdp defaults to -1
# (the rest) in base.yml, so every mesh sets it.
MESHES = {
    "fsdp8": {"ici_fsdp_parallelism": "8"},
    "dp8": {"ici_data_parallelism": "8", "ici_fsdp_parallelism": "1"},
    "tp2dp4": {"ici_tensor_parallelism": "2", "ici_data_parallelism": "4", "ici_fsdp_parallelism": "1"},
    "tp2fsdp4": {"ici_tensor_parallelism": "2", "ici_fsdp_parallelism": "4"},
    # MaxText splits each data shard's batch into the microbatches: 4 rows over data 4 need m = 2.
    "pp2dp4": {"ici_pipeline_parallelism": "2", "ici_data_parallelism": "4", "ici_fsdp_parallelism": "1",
               "num_pipeline_microbatches": "2"},
    "cp2dp4": {"ici_context_parallelism": "2", "ici_data_parallelism": "4", "ici_fsdp_parallelism": "1"},
}
DTYPES = {"fp32": {"dtype": "float32", "weight_dtype": "float32"}, "bf16": {"dtype": "bfloat16", "weight_dtype": "float32"}}
COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", choices=sorted(MESHES), default="fsdp8")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--remat", default="full", help="MaxText's remat_policy (none also turns layer scanning off)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "maxtext_peer"), help="logs and metrics")
    args, extra = parser.parse_known_args(argv)
    bad = [word for word in extra if "=" not in word or word.startswith("-")]
    if bad:
        parser.error(f"not KEY=VALUE: {' '.join(bad)}")
    return args, dict(word.split("=", 1) for word in extra)


def overrides(args, extra: dict) -> dict:
    """Every MaxText key this run sets (later entries win)."""
    label = f"{args.mesh}_{args.dtype}_remat-{args.remat}"
    # MaxText wraps each scanned layer in jax.checkpoint whatever the policy: no remat means no scan.
    remat = {"remat_policy": "none", "scan_layers": "false"} if args.remat == "none" else {"remat_policy": args.remat}
    return {
        **SETTINGS, **TINY_LLAMA, **DTYPES[args.dtype], **remat, **MESHES[args.mesh],
        "steps": str(args.steps), "run_name": label, "base_output_directory": os.path.join(args.out, "runs"),
        "metrics_file": os.path.join(args.out, f"{label}.metrics.jsonl"), **extra,
    }


def train(keys: dict, log: str) -> tuple[bool, str, dict]:
    """MaxText's trainer in this process, its output into `log`: (finished, why not, compile seconds by event)."""
    import jax

    compile_s = collections.Counter()

    def on_duration(event, duration, **kwargs):
        name = event.rsplit("/", 1)[-1]
        if name in COMPILE_EVENTS and "train_step" in str(kwargs.get("fun_name", "")):
            compile_s[name] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    argv = ["train.py", *(f"{key}={value}" for key, value in keys.items())]
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        try:
            from absl import app
            from maxtext.trainers.pre_train import train as maxtext_train  # its import talks too: into the log

            app.run(maxtext_train.main, argv=argv)  # absl's logging set up as MaxText's own command line has it
            ok, why = True, ""
        except SystemExit as e:
            ok = e.code in (0, None)
            why = "" if ok else f"exit {e.code}"
        except Exception as e:  # noqa: BLE001 - reported in the RESULT line
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    return ok, why, dict(compile_s)


def main(argv=None) -> int:
    args, extra = arguments(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices} " + os.environ.get("XLA_FLAGS", "")
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cold compile every run, as jaxpar's side
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.makedirs(args.out, exist_ok=True)
    keys = overrides(args, extra)
    if os.path.exists(keys["metrics_file"]):
        os.remove(keys["metrics_file"])
    log = os.path.join(args.out, f"{keys['run_name']}.log")
    ok, why, compile_s = train(keys, log)
    records = []
    if os.path.exists(keys["metrics_file"]):
        with open(keys["metrics_file"]) as f:
            records = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r.get("step", 0))
    devices = args.devices
    print(f"{'step':>4} {'step_s':>8} {'tokens/s':>10} {'loss':>8}")
    for r in records:
        nan = float("nan")
        tokens = r.get("perf/per_device_tokens_per_sec", nan) * devices
        print(f"{int(r['step']):>4} {r.get('perf/step_time_seconds', nan):>8.3f} {tokens:>10.1f} {r.get('learning/loss', nan):>8.4f}")
    times = [r["perf/step_time_seconds"] for r in records if "perf/step_time_seconds" in r]
    median = statistics.median(times[args.warmup:] or times) if times else None
    per_step = records[-1].get("perf/per_device_tokens") if records else None
    tokens_per_step = per_step * devices if per_step else None
    losses = [r["learning/loss"] for r in records if "learning/loss" in r]
    result = {
        "label": keys["run_name"], "ok": ok and bool(records), "error": why or ("" if records else f"no metrics; see {log}"),
        "devices": devices, "steps_logged": len(records),
        "compile_train_step_s": round(sum(compile_s.values()), 2),
        "median_step_s": round(median, 4) if median else None,
        "tokens_per_s": round(tokens_per_step / median, 1) if tokens_per_step and median else None,
        "first_loss": round(losses[0], 4) if losses else None, "final_loss": round(losses[-1], 4) if losses else None,
        "log": log,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
