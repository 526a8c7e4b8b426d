"""Convert between transformers checkpoints and jaxpar (Orbax) training checkpoints.

  python scripts/convert.py --from_hf=HF_DIR --to_checkpoint=OUT [--config=configs/X.py --config.K=V ...]
  python scripts/convert.py --from_checkpoint=DIR --to_hf=OUT [--overwrite] [--max_shard_bytes=N]

--from_hf: the model comes from HF_DIR/config.json, everything else from --config (default: the
  base config); OUT receives step 0 of a training run of that config (params from HF, fresh
  optimizer state). Train from it with the same --config and --config.checkpoint.dir=OUT: the run
  resumes from step 0 straight onto its own mesh. Each process reads only the slices of the
  safetensors tensors its devices hold (`jaxpar.interop.sharded`).
--from_checkpoint: DIR is a checkpoint directory or a workdir holding checkpoints/; its newest
  complete checkpoint's params go to OUT as config.json + float32 safetensors, sharded into files
  of at most --max_shard_bytes (default 5 GiB) with an index, fetched one layer at a time.
Add --cpu_devices=N to emulate N devices. Bad input: one line per problem on stderr, exit code 2.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

FLAGS = {
    "from_hf": str, "to_checkpoint": str, "from_checkpoint": str, "to_hf": str, "config": str,
    "overwrite": bool, "max_shard_bytes": int, "cpu_devices": int, "help": bool,
}


def _error(message) -> int:
    for line in str(message).splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 2


def _config(args, problems: list[str]):
    from jaxpar.config import base_config
    from jaxpar.train import cli

    try:
        config = cli.load_config(args.config) if args.config else base_config()
        cli.apply_overrides(config, args.overrides)
        return config
    except cli.UsageError as e:
        problems.append(str(e))
        return None


def to_checkpoint(args) -> int:
    import jax

    from jaxpar.train import preflight
    from jaxpar.checkpoint import Checkpoints
    from jaxpar.checkpoint.listing import finished_steps
    from jaxpar.interop import hf, sharded
    from jaxpar.train.setup import build

    problems = []
    config = _config(args, problems)
    try:
        model = hf.model_config(args.from_hf)
    except (OSError, ValueError) as e:
        return _error("\n".join(problems + [f"--from_hf={args.from_hf}: {e}"]))
    if config is None:
        return _error("\n".join(problems))
    config.model = model
    devices = jax.devices()
    try:
        preflight.check(config, len(devices), devices[0].platform)
    except preflight.ConfigError as e:
        problems.append(str(e))
    problems += sharded.problems(args.from_hf, config.model, key="--from_hf")
    if finished_steps(args.to_checkpoint):
        problems.append(f"--to_checkpoint={args.to_checkpoint} already holds checkpoints; choose an empty directory")
    if problems:
        return _error("\n".join(problems))
    program = build(config, devices)
    params = sharded.load_params_onto(args.from_hf, config.model, program.state_shardings.params, config.train.param_dtype)
    state = program.init_from_params(params)
    with Checkpoints(args.to_checkpoint, every_steps=0, keep=None) as checkpoints:
        checkpoints.save(0, state, data_state={"step": 0}, config=config.to_json_best_effort(), force=True)
        checkpoints.wait()
    if jax.process_index() == 0:
        print(
            f"wrote {os.path.join(os.path.abspath(args.to_checkpoint), '0')} ({config.model.model_type}); train from it "
            f"with the same --config and --config.checkpoint.dir={args.to_checkpoint}"
        )
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

    from jaxpar.checkpoint import CheckpointError, Checkpoints, abstract_state
    from jaxpar.checkpoint.listing import finished_steps, saved_config
    from jaxpar.interop import hf
    from jaxpar.train.setup import build

    directory = _checkpoint_dir(args.from_checkpoint)
    steps = finished_steps(directory)
    if not steps:
        return _error(f"--from_checkpoint={args.from_checkpoint} holds no complete checkpoint")
    if os.path.isdir(args.to_hf) and os.listdir(args.to_hf) and not args.overwrite:
        return _error(f"--to_hf={args.to_hf} is not empty; pass --overwrite to replace the checkpoint in it")
    devices = jax.devices()
    try:
        config = export_config(saved_config(directory, steps[-1]), len(devices))
        program = build(config, devices)
        with Checkpoints(directory, every_steps=0, read_only=True) as checkpoints:
            restored = checkpoints.restore(None, abstract_state(jax.eval_shape(program.init), program.state_shardings))
        hf.save(args.to_hf, config.model, restored.state.params, overwrite=args.overwrite, max_shard_bytes=args.max_shard_bytes)
    except (CheckpointError, OSError, ValueError) as e:
        return _error(e)
    if jax.process_index() == 0:
        print(f"wrote {args.to_hf} from checkpoint {restored.path} (step {restored.step})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxpar.interop.hf import DEFAULT_MAX_SHARD_BYTES
    from jaxpar.train import cli

    args = SimpleNamespace(**dict.fromkeys(FLAGS, ""), overrides=[])
    args.overwrite = args.help = False
    args.cpu_devices, args.max_shard_bytes = 0, DEFAULT_MAX_SHARD_BYTES
    args.overrides, problems = cli.parse_flags(sys.argv[1:] if argv is None else argv, FLAGS, args)
    if args.help:
        print(__doc__)
        return 0
    directions = [bool(args.from_hf and args.to_checkpoint), bool(args.from_checkpoint and args.to_hf)]
    if sum(directions) != 1:
        problems.append("give either --from_hf=DIR --to_checkpoint=OUT or --from_checkpoint=DIR --to_hf=OUT")
    if args.max_shard_bytes < 1:
        problems.append(f"--max_shard_bytes={args.max_shard_bytes} must be >= 1")
    if args.cpu_devices < 0:
        problems.append(f"--cpu_devices={args.cpu_devices} must be >= 0")
    if problems:
        return _error("\n".join(problems))

    import jax

    from jaxpar import distributed

    distributed.initialize()
    if args.cpu_devices and not os.environ.get("JAX_NUM_CPU_DEVICES"):
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    return to_checkpoint(args) if directions[0] else to_hf(args)


if __name__ == "__main__":
    sys.exit(main())
