"""Sample from a trained model: a run's checkpoint, a converted checkpoint or a transformers directory.

  python scripts/sample.py --workdir=RUN [--step=N] --prompt="Once upon" [--prompt=...]
  python scripts/sample.py --checkpoint=CKPT_DIR --prompt_file=prompts.txt --max_new_tokens=128
  python scripts/sample.py --from_hf=HF_DIR --prompt_ids="1,2,3;4,5" --temperature=0.8 --top_p=0.9

Weights: exactly one of --workdir (its newest complete checkpoint, or --step), --checkpoint (a
checkpoint directory, e.g. from scripts/convert.py --to_checkpoint) or --from_hf.
Prompts: --prompt=TEXT (repeatable), --prompt_file=FILE (one prompt per line), --prompt_ids=IDS
(comma-separated ids, prompts separated by ';'). Text is encoded with the run's tokenizer (bytes for
a byte-corpus run, the transformers tokenizer of a token-file run or of --from_hf).
Sampling: --max_new_tokens (64), --temperature (0: greedy, the default), --top_k (0: off), --top_p
(1: off), --seed (0), --num_samples per prompt (1), --eos_id (-1: the tokenizer's / config.json's).
Generation stops at EOS. Each completion is printed; --output=FILE writes one JSON object per
sample (prompt, sample, prompt_ids, completion_ids, text).
Mesh: --cpu_devices=N emulates N devices; --tensor splits heads and the KV cache, --expert the
experts, --data the prompt batch (defaults: the run's tensor and expert sizes, data the rest);
--pipeline / --context > 1 are refused.
Bad input: one line per problem on stderr, exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

FLAGS = {
    "workdir": str, "checkpoint": str, "step": int, "from_hf": str, "prompt_file": str, "prompt_ids": str,
    "max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int, "num_samples": int,
    "eos_id": int, "output": str, "cpu_devices": int, "data": int, "tensor": int, "expert": int,
    "pipeline": int, "context": int, "help": bool,
}
DEFAULTS = dict(
    workdir="", checkpoint="", step=-1, from_hf="", prompt_file="", prompt_ids="", max_new_tokens=64,
    temperature=0.0, top_k=0, top_p=1.0, seed=0, num_samples=1, eos_id=-1, output="", cpu_devices=0,
    data=0, tensor=0, expert=0, pipeline=0, context=0, help=False,
)
MESH_FLAGS = ("data", "pipeline", "context", "expert", "tensor")


def _error(message) -> int:
    for line in str(message).splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 2


def parse(argv: list[str]):
    """(args, problems): --prompt may repeat, so it is taken out before the flag table."""
    from jaxpar.train import cli

    texts, rest = [], []
    for i, arg in enumerate(argv):
        if arg.startswith("--prompt="):
            texts.append(arg[len("--prompt="):])
        elif arg == "--prompt" and i + 1 < len(argv):
            texts.append(None)  # the value follows
        elif texts and texts[-1] is None:
            texts[-1] = arg
        else:
            rest.append(arg)
    args = SimpleNamespace(**DEFAULTS, prompts_text=texts)
    overrides, problems = cli.parse_flags(rest, FLAGS, args)
    problems += [f"unknown flag --config.{key}; sample.py takes no config overrides" for key, _ in overrides]
    if args.help:
        return args, []
    sources = [name for name in ("workdir", "checkpoint", "from_hf") if getattr(args, name)]
    if len(sources) != 1:
        problems.append("give exactly one of --workdir, --checkpoint, --from_hf"
                        + (f" (got {', '.join('--' + s for s in sources)})" if sources else ""))
    if args.step != -1 and args.from_hf:
        problems.append("--step applies to --workdir / --checkpoint, not --from_hf")
    if not (texts or args.prompt_file or args.prompt_ids):
        problems.append("give a prompt: --prompt=TEXT, --prompt_file=FILE or --prompt_ids=1,2,3")
    for name in ("num_samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            problems.append(f"--{name}={getattr(args, name)} must be >= 1")
    for name in ("cpu_devices", *MESH_FLAGS):
        if getattr(args, name) < 0:
            problems.append(f"--{name}={getattr(args, name)} must be >= 0 (0: the default)")
    from jaxpar.sampling.filters import SamplingParams
    from jaxpar.sampling.filters import problems as sampling_problems

    args.sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    problems += [p for p in sampling_problems(args.sampling, vocab_size=1 << 31) if "top_k" not in p]
    if args.top_k < 0:
        problems.append(f"--top_k={args.top_k} must be >= 0 (0: off)")
    return args, problems


def prompt_ids(args, tokenizer) -> list[list[int]]:
    """Token ids of every prompt, in flag order: --prompt, --prompt_file, --prompt_ids."""
    from jaxpar.sampling import SampleError

    texts = list(args.prompts_text)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"--prompt_file={args.prompt_file}: {e}") from None
    if texts and tokenizer is None:
        raise SampleError("text prompts need a tokenizer and this model has none; give --prompt_ids=1,2,3")
    ids = [[int(t) for t in tokenizer.encode(text)] for text in texts]
    for part in filter(None, (p.strip() for p in args.prompt_ids.split(";"))):
        try:
            ids.append([int(t) for t in part.split(",") if t.strip()])
        except ValueError:
            raise SampleError(f"--prompt_ids: {part!r} is not comma-separated integers") from None
    return ids


def _decode(tokenizer, ids):
    return None if tokenizer is None else tokenizer.decode(ids)


def run(args) -> int:
    import jax

    from jaxpar.checkpoint import CheckpointError
    from jaxpar.mesh import MeshError
    from jaxpar.sampling import SampleError
    from jaxpar.sampling import load as loading

    requested = {axis: getattr(args, axis) for axis in MESH_FLAGS}
    devices = jax.devices()
    try:
        if args.from_hf:
            loaded = loading.from_hf(args.from_hf, requested, devices)
        else:
            directory, flag = loading.checkpoint_directory(args.workdir, args.checkpoint)
            loaded = loading.from_checkpoint(directory, flag, None if args.step == -1 else args.step, requested, devices)
        prompts = prompt_ids(args, loaded.tokenizer)
        eos = loaded.eos_id if args.eos_id == -1 else args.eos_id
        rows = [p for p in prompts for _ in range(args.num_samples)]
        sampler = loaded.sampler
        names = {"prompts": "prompts", "max_new_tokens": "--max_new_tokens", "eos_id": "--eos_id"}
        if errors := sampler.input_problems(rows, args.max_new_tokens, eos, names) + _vocab_problems(args, loaded):
            raise SampleError("\n".join(errors))
    except (SampleError, CheckpointError, MeshError) as e:
        return _error(e)
    n_rows, _, slots = sampler.buckets(rows, args.max_new_tokens)
    mesh = " ".join(f"{k}={v}" for k, v in sampler.mesh.shape.items())
    print(f"sampling from {loaded.source} on mesh {mesh}")
    print(f"KV cache: {sampler.cache_bytes_per_device(n_rows, slots) / 2**20:.2f} MiB per device ({n_rows} rows x {slots} slots)",
          flush=True)
    # Each of a prompt's samples draws differently: the batch rows differ, the seed is shared.
    result = sampler.generate(loaded.params, rows, args.max_new_tokens, args.sampling, args.seed, eos)
    records = []
    for i, completion in enumerate(result.completions):
        prompt, sample = divmod(i, args.num_samples)
        text = _decode(loaded.tokenizer, completion)
        records.append(dict(prompt=prompt, sample=sample, prompt_ids=rows[i], completion_ids=completion, text=text))
        print(f"--- prompt {prompt} sample {sample} ({len(completion)} tokens)")
        head = _decode(loaded.tokenizer, rows[i])
        print(f"{head}{text}" if text is not None else f"{rows[i]} -> {completion}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"wrote {len(records)} samples to {args.output}")
    return 0


def _vocab_problems(args, loaded) -> list[str]:
    if args.top_k > loaded.model_config.vocab_size:
        return [f"--top_k={args.top_k} must be between 0 (off) and the vocab size {loaded.model_config.vocab_size}"]
    return []


def main(argv: list[str] | None = None) -> int:
    args, problems = parse(sys.argv[1:] if argv is None else argv)
    if args.help:
        print(__doc__)
        return 0
    if problems:
        return _error("\n".join(problems))
    import jax

    if args.cpu_devices and not os.environ.get("JAX_NUM_CPU_DEVICES"):
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
