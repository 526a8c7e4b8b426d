"""Convert between transformers checkpoints and jaxpar (Orbax) training checkpoints.

  python scripts/convert.py --from_hf=HF_DIR --to_checkpoint=OUT --config=configs/X.py [--config.K=V ...]
  python scripts/convert.py --from_checkpoint=DIR --to_hf=OUT [--overwrite] [--max_shard_bytes=N] [--hf_dtype=bfloat16]
  python scripts/convert.py --from_checkpoint=DIR --to_peft=OUT [--base_model=NAME]

--from_hf: the model comes from HF_DIR/config.json (fields config.json cannot hold, such as
  Mixtral's router_z_loss_coef, from --config), everything else from --config; OUT, an empty or new
  directory (not a workdir), receives step 0 of a training run of that config (params from HF, fresh
  optimizer state). The train.py command printed at the end trains from it: the same --config and
  overrides, --config.model.KEY=VALUE for each model field where HF_DIR differs from --config, and
  --config.checkpoint.dir=OUT; the run resumes from step 0 straight onto its own mesh. Each process
  reads only the slices of the safetensors tensors its devices hold (`jaxpar.interop.sharded`).
--from_checkpoint: DIR is a checkpoint directory or a workdir holding checkpoints/; its newest
  complete checkpoint's params go to OUT as config.json + float32 safetensors, sharded into files
  of at most --max_shard_bytes (default 5 GiB) with an index, fetched one layer at a time. A LoRA
  run's (train.lora.rank > 0) go merged: each adapter folded into its matrix.
--to_peft: a LoRA run's adapters as a PEFT adapter (adapter_config.json + adapter_model.safetensors)
  that peft.PeftModel.from_pretrained loads onto the transformers base; --base_model is written as
  its base_model_name_or_path. A run trains from a PEFT adapter with train.lora.init_from_peft.
Add --cpu_devices=N to emulate N devices. Bad input: one line per problem on stderr, exit code 2.
"""

from __future__ import annotations

import os
import sys

from jaxpar import command
from jaxpar.command import Command, Flag

FLAGS = (
    Flag("from_hf", str, "", "a transformers checkpoint directory to convert (with --to_checkpoint and --config)"),
    Flag("to_checkpoint", str, "", "a new or empty directory: step 0 of a training run of --config"),
    Flag("from_checkpoint", str, "", "a checkpoint directory or a workdir holding checkpoints/ (with --to_hf)"),
    Flag("to_hf", str, "", "where config.json and the safetensors go"),
    Flag("to_peft", str, "", "where a LoRA run's adapters go in PEFT's format (with --from_checkpoint)"),
    Flag("base_model", str, "", "--to_peft: the adapter's base_model_name_or_path (a hub name or the base's folder)"),
    Flag("overwrite", bool, False, "replace the checkpoint in a non-empty --to_hf"),
    Flag("max_shard_bytes", int, None, "largest safetensors file --to_hf writes (default 5 GiB, as transformers)", at_least=1),
    Flag("hf_dtype", str, "float32", "what --to_hf writes: float32 (exact) or bfloat16 (as released checkpoints hold them)",
         choices=("float32", "bfloat16")),
)


def checks(args) -> list[str]:
    problems = []
    directions = [bool(args.from_hf and args.to_checkpoint), bool(args.from_checkpoint and (args.to_hf or args.to_peft))]
    if sum(directions) != 1:
        problems.append("give either --from_hf=DIR --to_checkpoint=OUT or --from_checkpoint=DIR --to_hf=OUT (or --to_peft=OUT)")
    elif directions[0] and not args.config:
        problems.append("--from_hf needs --config=CONFIG.py: the config of the run that will train from the checkpoint")
    if args.overrides and not args.config:
        problems.append(f"--config.{args.overrides[0][0]}: overrides need --config=FILE")
    return problems


def _destination_problems(out: str) -> list[str]:
    """--to_checkpoint must be a checkpoint directory of its own: not a workdir, no checkpoints yet."""
    from jaxpar.checkpoint.listing import finished_steps
    from jaxpar.checkpoint.storage import remote_problem
    from jaxpar.train.workdir import CHECKPOINTS, CONFIG_FILE, LOCK_FILE, METRICS_FILE

    if problem := remote_problem(out, key="--to_checkpoint"):
        return [problem]
    if os.path.isdir(out):
        found = [name for name in (CONFIG_FILE, METRICS_FILE, LOCK_FILE, CHECKPOINTS) if os.path.exists(os.path.join(out, name))]
        if found:
            return [
                f"--to_checkpoint={out} is a training workdir (it holds {', '.join(found)}); give a new or empty directory "
                f"and train with --config.checkpoint.dir pointing at it"
            ]
    if finished_steps(out):
        return [f"--to_checkpoint={out} already holds checkpoints; choose an empty directory"]
    return []


def _override_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "None" if value is None else str(value)


def _flat(tree: dict, prefix: str) -> dict:
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def train_command(args, given_model, saved_model) -> str:
    """The train.py command that resumes from the converted checkpoint: convert's own config and
    overrides, then each model field where the checkpoint differs from --config's model."""
    import shlex

    from jaxpar.config import resolve_derived

    given = _flat(resolve_derived({"model": given_model.to_dict()}), "")
    saved = _flat(resolve_derived({"model": saved_model.to_dict()}), "")
    words = ["python", "scripts/train.py", f"--config={args.config}"]
    words += [f"--config.{key}={text}" for key, text in args.overrides]
    words += [f"--config.{key}={_override_text(value)}" for key, value in saved.items() if given.get(key, value) != value]
    words += [f"--config.checkpoint.dir={os.path.abspath(args.to_checkpoint)}", "--workdir=WORKDIR"]
    words += [f"--cpu_devices={args.cpu_devices}"] if args.cpu_devices else []
    return " ".join(shlex.quote(word) for word in words)


def to_checkpoint(args, config) -> int:
    import jax

    from jaxpar.checkpoint import Checkpoints
    from jaxpar.checkpoint.listing import CONVERTED_FROM
    from jaxpar.interop import hf, sharded
    from jaxpar.models import lora
    from jaxpar.train import preflight
    from jaxpar.train.setup import build

    problems = []
    try:
        model = hf.model_config(args.from_hf)
    except (OSError, ValueError) as e:
        return command.error(f"--from_hf={args.from_hf}: {e}")
    given_model = config.model
    if given_model.get("model_type") != model.model_type:
        return command.error(
            f"--config={args.config} has model.model_type={given_model.get('model_type')!r} but --from_hf={args.from_hf} "
            f"holds a {model.model_type!r} model; give a {model.model_type} config"
        )
    config.model = hf.with_jaxpar_fields(model, given_model)
    devices = jax.devices()
    try:
        preflight.check(config, len(devices), devices[0].platform)
    except preflight.ConfigError as e:
        problems.append(str(e))
    problems += sharded.problems(args.from_hf, config.model, key="--from_hf")
    problems += _destination_problems(args.to_checkpoint)
    if problems:
        return command.error("\n".join(problems))
    program = build(config, devices)
    params = sharded.load_params_onto(args.from_hf, config.model, lora.base_of(program.state_shardings.params), config.train.param_dtype)
    state = program.to_natural(program.init_from_params(params))  # checkpoints hold the natural layer order
    # Tells a run refusing this checkpoint that it holds converted weights, not an earlier run.
    data_state = {"step": 0, CONVERTED_FROM: os.path.abspath(args.from_hf)}
    with Checkpoints(args.to_checkpoint, every_steps=0, keep=None) as checkpoints:
        checkpoints.save(0, state, data_state=data_state, config=config.to_json_best_effort(), force=True)
        checkpoints.wait()
    if jax.process_index() == 0:
        print(f"wrote {os.path.join(os.path.abspath(args.to_checkpoint), '0')} ({config.model.model_type}); train from it with")
        print(f"  {train_command(args, given_model, config.model)}")
    return 0


def _checkpoint_dir(path: str) -> str:
    from jaxpar.checkpoint.listing import finished_steps
    from jaxpar.train.workdir import CHECKPOINTS

    nested = os.path.join(path, CHECKPOINTS)
    return nested if not finished_steps(path) and finished_steps(nested) else path


def export_config(saved: dict, num_devices: int):
    """The saved run's config laid out to restore on `num_devices` devices: all on `data`, params
    sharded over them (ZeRO-3) when the hidden size allows."""
    from ml_collections import ConfigDict

    from jaxpar.axes import DATA, MESH_AXES

    config = ConfigDict(saved)
    config.mesh = ConfigDict({name: num_devices if name == DATA else 1 for name in MESH_AXES})
    config.parallel.zero_stage = 3 if config.model.hidden_size % num_devices == 0 else 0
    config.parallel.sequence_parallel = False
    return config


def to_hf(args) -> int:
    import jax

    from jaxpar import models
    from jaxpar.checkpoint import CheckpointError, Checkpoints, abstract_state
    from jaxpar.checkpoint.listing import finished_steps, saved_config
    from jaxpar.checkpoint.storage import remote_problem
    from jaxpar.interop import hf, peft
    from jaxpar.models import lora
    from jaxpar.models.fp8_state import without_histories
    from jaxpar.train.setup import build

    if problem := remote_problem(args.from_checkpoint, key="--from_checkpoint"):
        return command.error(problem)
    directory = _checkpoint_dir(args.from_checkpoint)
    steps = finished_steps(directory)
    if not steps:
        return command.error(f"--from_checkpoint={args.from_checkpoint} holds no complete checkpoint")
    if args.to_hf and os.path.isdir(args.to_hf) and os.listdir(args.to_hf) and not args.overwrite:
        return command.error(f"--to_hf={args.to_hf} is not empty; pass --overwrite to replace the checkpoint in it")
    devices = jax.devices()
    try:
        config = export_config(saved_config(directory, steps[-1]), len(devices))
        adapters = lora.settings(lora.adapted(config.model, config.train.lora) if "lora" in config.train else config.model)
        if args.to_peft and adapters is None:
            return command.error(f"--to_peft: the run in --from_checkpoint={args.from_checkpoint} has no LoRA adapters (train.lora.rank=0)")
        program = build(config, devices)
        with Checkpoints(directory, every_steps=0, read_only=True) as checkpoints:
            restored = checkpoints.restore(None, abstract_state(jax.eval_shape(program.init), program.state_shardings))
        params = restored.state.params
        if args.to_peft:
            peft.export(args.to_peft, program.model_config, jax.device_get(params), base_model=args.base_model)
        if args.to_hf:
            if adapters is not None:  # the merged model: each adapter folded into its matrix
                params = jax.jit(lambda p: lora.merged(p, adapters, models.logical_axes(program.model_config)))(params)
            params = without_histories(params)  # delayed FP8 scaling's state steers training only
            hf.save(args.to_hf, config.model, params, overwrite=args.overwrite, max_shard_bytes=args.max_shard_bytes,
                    dtype=args.hf_dtype)
    except (CheckpointError, OSError, ValueError) as e:
        return command.error(e)
    if jax.process_index() == 0:
        for out in (args.to_hf, args.to_peft):
            if out:
                print(f"wrote {out} from checkpoint {restored.path} (step {restored.step})")
    return 0


def run(args, config) -> int:
    from jaxpar import distributed

    distributed.initialize()
    if args.from_hf:
        return to_checkpoint(args, config)
    if args.max_shard_bytes is None:
        from jaxpar.interop.hf import DEFAULT_MAX_SHARD_BYTES

        args.max_shard_bytes = DEFAULT_MAX_SHARD_BYTES
    return to_hf(args)


COMMANDS = (Command(None, "convert between transformers checkpoints and jaxpar checkpoints", run, flags=FLAGS,
                    config="optional", checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
