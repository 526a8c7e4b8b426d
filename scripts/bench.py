"""Time jaxpar's real train step (and its decoding) beside what it is compared with.

  python scripts/bench.py step [--model=llama|mixtral] [--steps=6] [--repeats=1] [--peer] [--remat=full] [--profile=DIR]
  python scripts/bench.py generate [--new_tokens=256] [--batch=4] [--prompt_len=32] [--repeats=1]
  python scripts/bench.py mesh [--mesh=fsdp8,dp8,tp2dp4,pp2dp4] [--remat=full,none] [--repeats=3] [--maxtext]
  python scripts/bench.py moe [--experts=64] [--top_k=8] [--expert_ffn=128] [--shape=qwen3_moe|deepseek_v3] [--steps=4] [--repeats=3]
  python scripts/bench.py packing [--model=llama|mixtral] [--steps=10] [--repeats=3] [--attention=jaxpar_xla,xla]
  python scripts/bench.py checkpoint [--dirs=/dev/shm,/tmp] [--steps=20] [--every=5] [--repeats=3]
  python scripts/bench.py lora [--mesh=data:2,tensor:2] [--zero_stage=1] [--rank=16] [--steps=4] [--repeats=3]
  python scripts/bench.py window [--seq=8192] [--window=512] [--tiles=1,2,4,8] [--repeats=3]
  python scripts/bench.py collective_matmul [--sizes=small,large] [--modes=none,permutes] [--steps=2] [--repeats=5]
  python scripts/bench.py faults [--train_config=configs/llama_tiny.py] [--steps=60] [--every=20] [--at=35] [--repeats=1]

Each times the step through `jaxpar.train.harness` (warm-up excluded); what each prints is in the
docstring of its module in `jaxpar.bench`. Contenders alternate within one invocation, because on a
shared machine the load moves between invocations more than the differences being measured. The peers
(`step --peer`: transformers + PyTorch, `mesh --maxtext`: MaxText) live in benchmarks/peers/, each with
its README, install step and environment.
"""

from __future__ import annotations

import os
import sys
import tempfile

from jaxpar import command
from jaxpar.bench import refusing_bad_configs
from jaxpar.command import Command, Flag, UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_PEER = os.path.join(ROOT, "benchmarks", "peers", "hf_torch", "train_step.py")
MAXTEXT_RUNNER = os.path.join(ROOT, "benchmarks", "peers", "maxtext", "run_tiny.py")
MAXTEXT_PYTHON = os.environ.get("MAXTEXT_PYTHON", os.path.expanduser("~/.cache/jaxpar/maxtext-venv/bin/python"))
MESH_NAMES = ("fsdp8", "dp8", "tp2dp4", "tp2fsdp4", "pp2dp4", "cp2dp4", "one")


def bench_config(model: str):
    from jaxpar.command.config_file import load_config

    return load_config(os.path.join(ROOT, "configs", f"bench_{model}.py"))


@refusing_bad_configs
def run_step(args, _):
    from jaxpar.bench import step

    config = bench_config(args.model)
    if args.remat:
        config.parallel.remat = args.remat
    if args.peer and not os.path.exists(args.peer_python):
        raise UsageError(f"--peer_python={args.peer_python} does not exist")
    with tempfile.TemporaryDirectory(prefix="jaxpar_peer_") as folder:  # the peer's config.json
        peer = None
        if args.peer:
            train = config.train
            command_line = [args.peer_python, HF_PEER, f"--config_dir={step.write_peer_config(config, folder)}",
                            f"--batch={train.global_batch_size}", f"--seq_len={train.seq_len}", f"--steps={args.steps}",
                            f"--threads={args.threads}"]
            print(f"peer: {' '.join(command_line)}", flush=True)

            def peer():
                return step.peer_line(command_line)

        step.bench(config, args.model, args.steps, args.repeats, peer, args.profile)


def run_generate(args, _):
    from jaxpar.bench import generate

    shape = generate.Shape(args.new_tokens, args.batch, args.prompt_len, args.hidden, args.layers, args.heads, args.kv_heads, args.vocab)
    return generate.bench(shape, args.threads, args.repeats)


@refusing_bad_configs
def run_mesh(args, _):
    import json

    from jaxpar.bench import mesh

    base = mesh_base_config()
    if args.worker:
        print("RESULT " + json.dumps(mesh.worker(base, json.loads(args.worker))), flush=True)
        return 0
    trees = args.trees or [ROOT]
    sides = {}
    for tree in trees:
        label = f"jaxpar[{os.path.basename(tree.rstrip('/'))}]" if len(trees) > 1 else "jaxpar"
        sides[label] = lambda m, r, tree=tree: mesh.run_jaxpar(
            tree, {"mesh": m, "remat": r, "steps": args.steps, "overrides": args.override})
    if args.maxtext:
        model = mesh.maxtext_overrides(base)
        sides["maxtext"] = lambda m, r: mesh.run_maxtext(args.maxtext_python, MAXTEXT_RUNNER, m, r, args.steps, model)
    runs = mesh.matrix(args.mesh, args.remat, args.repeats, sides)
    print(f"\nload average at the end: {os.getloadavg()}\n")
    print("\n".join(mesh.table(runs, args.mesh, args.remat, list(sides))))


def mesh_base_config():
    from jaxpar.command.config_file import load_config

    return load_config(os.path.join(ROOT, "configs", "maxtext_tiny.py"))


def mesh_checks(args) -> list[str]:
    from jaxpar.bench.mesh import override_problems

    problems = override_problems(args.override)
    problems += [f"--trees={tree}: no scripts/bench.py there" for tree in args.trees
                 if not os.path.isfile(os.path.join(tree, "scripts", "bench.py"))]
    return problems


@refusing_bad_configs
def run_moe(args, _):
    if args.a2a_experts:  # before JAX starts its backends: the a2a layouts need 8 devices
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    from jaxpar.bench import moe

    moe.bench(args.experts, args.top_k, args.expert_ffn, args.steps, args.repeats, [int(e) for e in args.a2a_experts], args.a2a_dir,
              args.shape)


@refusing_bad_configs
def run_packing(args, _):
    from jaxpar.bench import packing

    def config_for(impl):
        config = bench_config(args.model)
        config.parallel.attention_impl = impl
        return config

    packing.bench(config_for, args.model, args.attention, args.steps, args.repeats)


@refusing_bad_configs
def run_checkpoint(args, _):
    from jaxpar.bench import checkpoint

    checkpoint.bench(bench_config("llama"), args.dirs, args.steps, args.every, args.repeats)


def checkpoint_checks(args) -> list[str]:
    problems = [f"--dirs={d}: not a writable directory" for d in args.dirs if not (os.path.isdir(d) and os.access(d, os.W_OK))]
    return problems + ([] if args.every <= args.steps else [f"--every={args.every} is more than --steps={args.steps}: no save"])


@refusing_bad_configs
def run_lora(args, _):
    from jaxpar.bench import lora

    config = bench_config("llama")
    config.parallel.zero_stage = args.zero_stage
    lora.bench(config, args.mesh, args.rank, args.steps, args.repeats)


@refusing_bad_configs
def run_collective_matmul(args, _):
    import jax

    from jaxpar.bench import collective_matmul

    if jax.device_count() < collective_matmul.DEVICES:
        raise UsageError(f"collective_matmul runs on {collective_matmul.DEVICES} devices; give --cpu_devices={collective_matmul.DEVICES}")
    collective_matmul.bench(mesh_base_config(), args.sizes, args.modes, args.steps, args.repeats)


def mesh_sizes(text: str) -> dict:
    """"data:2,tensor:2" -> {"data": 2, "tensor": 2}."""
    sizes = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition(":")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"{part!r} is not AXIS:SIZE")
        sizes[name.strip()] = int(size)
    return sizes


def lora_checks(args) -> list[str]:
    from jaxpar.axes import MESH_AXES

    try:
        args.mesh = mesh_sizes(args.mesh)
    except ValueError as e:
        return [f"--mesh: {e}"]
    unknown = [name for name in args.mesh if name not in MESH_AXES]
    return [f"--mesh: unknown axis {unknown[0]!r} (axes: {', '.join(MESH_AXES)})"] if unknown else []


def run_faults(args, _):
    from jaxpar.bench import faults

    faults.bench(ROOT, os.path.abspath(args.train_config), args.steps, args.every, args.at, args.local_every, args.repeats)


def faults_checks(args) -> list[str]:
    problems = [] if os.path.isfile(args.train_config) else [f"--train_config={args.train_config}: no such file"]
    return problems + ([] if args.at < args.steps else [f"--at={args.at} must be below --steps={args.steps}"])


def run_window(args, _):
    from jaxpar.bench import window

    print("\n".join(window.bench(args.seq, args.window, args.heads, args.kv_heads, args.head_dim, args.repeats,
                                 [int(n) for n in args.tiles])))


def window_checks(args) -> list[str]:
    problems = _positive_ints("tiles", args.tiles)
    if args.heads % args.kv_heads:
        problems.append(f"--kv_heads={args.kv_heads} must divide --heads={args.heads}")
    return problems


def _default_dirs() -> list[str]:
    """A RAM disk (a local tier's fastest storage) when there is one, and the disk under the temp folder."""
    return [d for d in ("/dev/shm",) if os.path.isdir(d)] + [tempfile.gettempdir()]


def _positive_ints(name: str, words: list[str]) -> list[str]:
    return [f"--{name}={w}: not a positive integer" for w in words if not (w.isdigit() and int(w) > 0)]


STEPS = Flag("steps", int, 6, "timed steps per block, after warm-up (compile and one step)", at_least=1)
MODEL = Flag("model", str, "llama", "the bench config: configs/bench_llama.py or configs/bench_mixtral.py", choices=("llama", "mixtral"))
THREADS = Flag("threads", int, 2, "CPU threads for torch (the peer, transformers' generate)", at_least=1)

COMMANDS = (
    Command("step", "the bench config's train step on one device, optionally beside transformers + PyTorch", run_step, flags=(
        MODEL, STEPS,
        Flag("repeats", int, 1, "timed blocks (each followed by a peer run with --peer)", at_least=1),
        Flag("peer", bool, False, "also run benchmarks/peers/hf_torch/train_step.py on the same model and batch, interleaved"),
        Flag("peer_python", str, sys.executable, "the Python of the peer's environment (it needs torch and transformers)"),
        THREADS,
        Flag("remat", str, "", "override parallel.remat (default: the config's)"),
        Flag("profile", str, "", "trace two more steps into this folder and print the per-scope breakdown"),
    )),
    Command("generate", "decode tokens/s: KV cache, recomputing, transformers' generate, on the same weights", run_generate, flags=(
        Flag("new_tokens", int, 256, "new tokens per prompt", at_least=1),
        Flag("batch", int, 4, "prompts", at_least=1),
        Flag("prompt_len", int, 32, "tokens per prompt", at_least=1),
        Flag("hidden", int, 256, "hidden_size", at_least=1),
        Flag("layers", int, 4, "num_hidden_layers", at_least=1),
        Flag("heads", int, 8, "num_attention_heads", at_least=1),
        Flag("kv_heads", int, 2, "num_key_value_heads", at_least=1),
        Flag("vocab", int, 2048, "vocab_size", at_least=2),
        THREADS,
        Flag("repeats", int, 1, "timed runs of each contender (the fastest counts)", at_least=1),
    )),
    Command("mesh", "jaxpar beside MaxText on MaxText's tiny Llama, 8 emulated devices, the same meshes", run_mesh, flags=(
        Flag("mesh", list, "fsdp8,dp8,tp2dp4,pp2dp4", "meshes by MaxText's runner names (one: the whole batch on one device)",
             choices=MESH_NAMES),
        Flag("remat", list, "full", "remat policies (each side's own names; none on both)"),
        Flag("repeats", int, 3, "interleaved repetitions of the whole matrix", at_least=1),
        Flag("steps", int, 10, "steps per run; the median is taken after the first 3", at_least=1),
        Flag("maxtext", bool, False, "also run benchmarks/peers/maxtext/run_tiny.py, interleaved"),
        Flag("maxtext_python", str, MAXTEXT_PYTHON, "the Python of the MaxText environment (benchmarks/peers/maxtext/README.md; "
             "env MAXTEXT_PYTHON)"),
        Flag("trees", list, "", "jaxpar source trees to compare, interleaved (default: this one)"),
        Flag("override", str, repeat=True, help="SECTION.KEY=VALUE for jaxpar's config (Python literals)"),
        Flag("worker", str, "", "internal: run one jaxpar measurement (a JSON spec) in this process"),
    ), devices=False, checks=mesh_checks),
    Command("moe", "fine-grained experts against a dense model of the same active FLOPs, on one device", run_moe, flags=(
        Flag("experts", int, 64, "routed experts", at_least=1),
        Flag("top_k", int, 8, "experts per token", at_least=1),
        Flag("expert_ffn", int, 128, "hidden size of one expert", at_least=1),
        Flag("steps", int, 4, "timed steps per block", at_least=1),
        Flag("repeats", int, 3, "alternating blocks per model", at_least=1),
        Flag("a2a_experts", list, "", "expert counts to profile on data 2 x expert 4 (8 devices)"),
        Flag("a2a_dir", str, os.path.join(tempfile.gettempdir(), "bench_moe_profiles"), "where the a2a profiles go"),
        Flag("shape", str, "qwen3_moe", "the MoE model: qwen3_moe, or deepseek_v3 (MLA, sigmoid group-limited routing, a shared expert)",
             choices=("qwen3_moe", "deepseek_v3")),
    ), devices=False, checks=lambda args: _positive_ints("a2a_experts", args.a2a_experts)),
    Command("packing", "the bench config's step on packed documents beside one sequence per row", run_packing, flags=(
        MODEL, Flag("steps", int, 10, "timed steps per block, after warm-up", at_least=1),
        Flag("repeats", int, 3, "blocks per batch, rotating over the batches", at_least=1),
        Flag("attention", list, "jaxpar_xla,xla", "parallel.attention_impl values to time"),
    )),
    Command("checkpoint", "what a save costs the steps, per storage (a tier's directory), beside no saves", run_checkpoint,
            checks=checkpoint_checks, flags=(
        Flag("dirs", list, ",".join(_default_dirs()), "directories to save in, one run each (default: /dev/shm, the temp folder)"),
        Flag("steps", int, 20, "train steps per run", at_least=2),
        Flag("every", int, 5, "a save every this many steps", at_least=1),
        Flag("repeats", int, 3, "runs per storage, alternating", at_least=1),
    )),
    Command("lora", "LoRA beside full fine-tuning of the bench model on one mesh: compiled memory and step time", run_lora,
            checks=lora_checks, flags=(
        Flag("mesh", str, "data:2,tensor:2", "the mesh, AXIS:SIZE comma-separated (needs --cpu_devices for more than one CPU device)"),
        Flag("zero_stage", int, 1, "parallel.zero_stage of both runs", choices=(0, 1, 3)),
        Flag("rank", int, 16, "train.lora.rank of the LoRA run (targets: every attention and MLP matrix)", at_least=1),
        Flag("steps", int, 4, "timed steps per block", at_least=1),
        Flag("repeats", int, 3, "alternating blocks per contender", at_least=1),
    )),
    Command("collective_matmul", "parallel.collective_matmul's modes side by side on 8 emulated devices, two model sizes",
            run_collective_matmul, flags=(
        Flag("sizes", list, "small,large", "model sizes (jaxpar/bench/collective_matmul.py)", choices=("small", "large")),
        Flag("modes", list, "none,permutes", "parallel.collective_matmul values, the first the baseline",
             choices=("none", "permutes", "xla")),
        Flag("steps", int, 2, "timed steps per block", at_least=1),
        Flag("repeats", int, 5, "blocks per contender, rotating", at_least=1),
    )),
    Command("window", "a sliding layer's attention (masked, and the band kernel) beside full causal attention", run_window,
            checks=window_checks, flags=(
        Flag("seq", int, 8192, "tokens", at_least=2),
        Flag("window", int, 512, "the sliding window", at_least=1),
        Flag("heads", int, 8, "query heads", at_least=1),
        Flag("kv_heads", int, 2, "KV heads (dividing --heads)", at_least=1),
        Flag("head_dim", int, 64, "head dimension", at_least=1),
        Flag("tiles", list, "1,2,4,8", "band kernel tile counts per window to time"),
        Flag("repeats", int, 3, "alternating rounds", at_least=1),
    )),
    Command("faults", "what a preemption, a kill -9 and a kill with a local tier cost a run's goodput", run_faults,
            checks=faults_checks, devices=False, flags=(
        Flag("train_config", str, os.path.join("configs", "llama_tiny.py"), "the config scripts/train.py trains"),
        Flag("steps", int, 60, "train steps of each run", at_least=2),
        Flag("every", int, 20, "checkpoint.every_steps", at_least=1),
        Flag("at", int, 35, "the fault comes after this step", at_least=1),
        Flag("local_every", int, 5, "checkpoint.local_every_steps of the kill+local run", at_least=1),
        Flag("repeats", int, 1, "runs per scenario, alternating", at_least=1),
    )),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
