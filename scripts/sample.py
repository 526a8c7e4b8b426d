"""Sample from a trained model: a run's checkpoint, a converted checkpoint or a transformers directory.

  python scripts/sample.py --workdir=RUN [--step=N] --prompt="Once upon" [--prompt=...]
  python scripts/sample.py --checkpoint=CKPT_DIR --prompt_file=prompts.txt --max_new_tokens=128
  python scripts/sample.py --from_hf=HF_DIR --prompt_ids="1,2,3;4,5" --temperature=0.8 --top_p=0.9

Weights: exactly one of --workdir (its newest complete checkpoint, or --step), --checkpoint (a
checkpoint directory, e.g. from scripts/convert.py --to_checkpoint) or --from_hf.
Prompts: --prompt=TEXT (repeatable), --prompt_file=FILE (one prompt per line), --prompt_ids=IDS
(comma-separated ids, prompts separated by ';'); --chat renders each text prompt as a user message
with the tokenizer's chat template. A LoRA run's checkpoint is sampled with its adapters folded in.
Text is encoded with the run's tokenizer (bytes for
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

from jaxpar import command
from jaxpar.command import Command, Flag

MESH_FLAGS = ("data", "pipeline", "context", "expert", "tensor")
FLAGS = (
    Flag("workdir", str, "", "a training workdir: its newest complete checkpoint (or --step)"),
    Flag("checkpoint", str, "", "a checkpoint directory (e.g. from scripts/convert.py --to_checkpoint)"),
    Flag("step", int, -1, "the checkpoint step to load (-1: the newest complete one)", at_least=-1),
    Flag("from_hf", str, "", "a transformers checkpoint directory"),
    Flag("prompt", str, repeat=True, help="a text prompt (repeatable)"),
    Flag("prompt_file", str, "", "a file of prompts, one per line"),
    Flag("prompt_ids", str, "", "token-id prompts: comma-separated ids, prompts separated by ';'"),
    Flag("chat", bool, False, "each text prompt is a user message rendered by the tokenizer's chat template (with the "
         "generation prompt), as chat fine-tuning rendered conversations"),
    Flag("max_new_tokens", int, 64, "new tokens per sample", at_least=1),
    Flag("temperature", float, 0.0, "0: greedy"),
    Flag("top_k", int, 0, "keep the k most likely tokens (0: off)", at_least=0),
    Flag("top_p", float, 1.0, "keep the most likely tokens holding this much probability (1: off)"),
    Flag("seed", int, 0, "sampling seed (each of a prompt's samples draws differently)"),
    Flag("num_samples", int, 1, "samples per prompt", at_least=1),
    Flag("eos_id", int, -1, "stop token (-1: the tokenizer's / config.json's)"),
    Flag("output", str, "", "write one JSON object per sample to this file"),
    *(Flag(axis, int, 0, f"mesh.{axis} of the sampling mesh (0: the default)", at_least=0) for axis in MESH_FLAGS),
)


def checks(args) -> list[str]:
    """Problems among flags that only make sense together (each flag alone was checked while parsing)."""
    from jaxpar.loading.load import source_problems
    from jaxpar.sampling.filters import SamplingParams
    from jaxpar.sampling.filters import problems as sampling_problems

    problems = source_problems(args.workdir, args.checkpoint, args.from_hf, args.step)
    if not (args.prompt or args.prompt_file or args.prompt_ids):
        problems.append("give a prompt: --prompt=TEXT, --prompt_file=FILE or --prompt_ids=1,2,3")
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        problems.append(f"--prompt_file={args.prompt_file} is not a file")
    problems += _output_problems(args.output)
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    return problems + [p for p in sampling_problems(params, vocab_size=1 << 31) if "top_k" not in p]


def _output_problems(output: str) -> list[str]:
    """--output must be writable before anything is generated (not found missing afterwards)."""
    if not output:
        return []
    folder = os.path.dirname(os.path.abspath(output))
    if os.path.isdir(output):
        return [f"--output={output} is a folder; name a file"]
    if not os.path.isdir(folder):
        return [f"--output={output}: its folder {folder} does not exist"]
    if not os.access(folder, os.W_OK) or (os.path.exists(output) and not os.access(output, os.W_OK)):
        return [f"--output={output} is not writable"]
    return []


def prompt_ids(args, tokenizer) -> list[list[int]]:
    """Token ids of every prompt, in flag order: --prompt, --prompt_file, --prompt_ids."""
    from jaxpar.sampling import SampleError

    texts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"--prompt_file={args.prompt_file}: {e}") from None
    if texts and tokenizer is None:
        raise SampleError("text prompts need a tokenizer and this model has none; give --prompt_ids=1,2,3")
    ids = [[int(t) for t in chat_ids(tokenizer, text)] for text in texts] if args.chat else \
        [[int(t) for t in tokenizer.encode(text)] for text in texts]
    for part in filter(None, (p.strip() for p in args.prompt_ids.split(";"))):
        try:
            ids.append([int(t) for t in part.split(",") if t.strip()])
        except ValueError:
            raise SampleError(f"--prompt_ids: {part!r} is not comma-separated integers") from None
    return ids


def chat_ids(tokenizer, text: str) -> list[int]:
    """A user message rendered by the tokenizer's chat template with the assistant's generation prompt
    (rendered to text, then encoded, as `jaxpar.data.chat` renders training conversations)."""
    from jaxpar.data import ByteTokenizer
    from jaxpar.sampling import SampleError

    if tokenizer is None or isinstance(tokenizer, ByteTokenizer) or not tokenizer.chat_template:
        raise SampleError("--chat needs a tokenizer with a chat template and this model's tokenizer has none")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _decode(tokenizer, ids):
    return None if tokenizer is None else tokenizer.decode(ids)


def run(args, _) -> int:
    import jax

    from jaxpar.checkpoint import CheckpointError
    from jaxpar.loading import load as loading
    from jaxpar.mesh import MeshError
    from jaxpar.sampling import SampleError
    from jaxpar.sampling.filters import SamplingParams

    args.sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    requested = {axis: getattr(args, axis) for axis in MESH_FLAGS}
    devices = jax.devices()
    try:
        if args.from_hf:
            loaded = loading.from_hf_dir(args.from_hf, requested, devices)
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
        return command.error(e)
    n_rows, _, slots = sampler.buckets(rows, args.max_new_tokens)
    mesh = " ".join(f"{k}={v}" for k, v in sampler.mesh.shape.items())
    print(f"sampling from {loaded.source} on mesh {mesh}")
    kept, full = sampler.cache_bytes_per_sequence(slots)
    bounded = f"; sliding layers keep their window: {kept / 2**20:.2f} MiB per sequence, not {full / 2**20:.2f}" if kept < full else ""
    print(f"KV cache: {sampler.cache_bytes_per_device(n_rows, slots) / 2**20:.2f} MiB per device ({n_rows} rows x {slots} slots)"
          f"{bounded}", flush=True)
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


COMMANDS = (Command(None, "sample from a trained model", run, flags=FLAGS, checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
