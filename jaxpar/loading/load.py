"""A trained run or a transformers checkpoint, loaded for inference on a mesh of the devices.

A run's checkpoint (`--workdir`, its newest complete step or `--step`), a checkpoint directory
(`scripts/convert.py --to_checkpoint`, or a run's `checkpoints/`), or a transformers directory
(`--from_hf`), each as a `jaxpar.sampling.load.Loaded` (the sampling mesh, tokenizer and EOS rules
are there). Checkpoints are restored as resume does: the saved config's train state laid out for
the sampling mesh (ZeRO off, sequence parallelism off), so a checkpoint saved on one mesh samples on
any other; each process reads only the shards its devices hold. A config saved before a key existed
reads that key as its default (`jaxpar.config.with_defaults`). Users: scripts/sample.py, and
lm-eval's `--model jaxpar` (`jaxpar.loading.lm_eval`).
"""

from __future__ import annotations

import json
import os

import jax
from ml_collections import ConfigDict

from jaxpar import models
from jaxpar.axes import MESH_AXES
from jaxpar.config import with_defaults
from jaxpar.models import lora
from jaxpar.models.fp8_state import without_histories
from jaxpar.sampling.engine import SampleError, Sampler
from jaxpar.sampling.load import TOKENIZER_FILES, Loaded, eos_id, run_tokenizer, sampling_mesh, tokenizer_at


def source_problems(workdir: str, checkpoint: str, from_hf: str, step: int) -> list[str]:
    """The command-line checks of where a model comes from (scripts/sample.py, scripts/harness.py)."""
    problems = []
    sources = [name for name, value in (("workdir", workdir), ("checkpoint", checkpoint), ("from_hf", from_hf)) if value]
    if len(sources) != 1:
        problems.append("give exactly one of --workdir, --checkpoint, --from_hf"
                        + (f" (got {', '.join('--' + s for s in sources)})" if sources else ""))
    if step != -1 and from_hf:
        problems.append("--step applies to --workdir / --checkpoint, not --from_hf")
    return problems


def load(workdir: str = "", checkpoint: str = "", step: int = -1, from_hf: str = "", mesh: dict | None = None) -> Loaded:
    """`Loaded` for exactly one of workdir / checkpoint / from_hf, on a mesh of the devices (`mesh`:
    axis sizes as scripts/sample.py takes them; 0 or absent: the defaults)."""
    sources = [name for name, value in (("workdir", workdir), ("checkpoint", checkpoint), ("from_hf", from_hf)) if value]
    if len(sources) != 1:
        raise SampleError(f"give exactly one of workdir=, checkpoint=, from_hf= (got {sources or 'none'})")
    requested = {axis: int((mesh or {}).get(axis, 0)) for axis in MESH_AXES}
    if from_hf:
        return from_hf_dir(from_hf, requested, jax.devices())
    directory, flag = checkpoint_directory(workdir, checkpoint)
    return from_checkpoint(directory, flag, None if int(step) == -1 else int(step), requested, jax.devices())


def checkpoint_directory(workdir: str = "", checkpoint: str = "") -> tuple[str, str]:
    """(checkpoint directory, the flag that named it) for --workdir or --checkpoint."""
    from jaxpar.checkpoint.listing import finished_steps
    from jaxpar.train.workdir import CHECKPOINTS, CONFIG_FILE, checkpoint_dir

    if checkpoint:
        nested = os.path.join(checkpoint, CHECKPOINTS)
        if not finished_steps(checkpoint) and finished_steps(nested):
            return nested, f"--checkpoint={checkpoint}"
        return checkpoint, f"--checkpoint={checkpoint}"
    config_file = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isdir(workdir):
        raise SampleError(f"--workdir={workdir} does not exist")
    if not os.path.exists(config_file):
        raise SampleError(f"--workdir={workdir} holds no {CONFIG_FILE}: not a training workdir")
    with open(config_file) as f:
        config = ConfigDict(json.load(f))
    return checkpoint_dir(config, workdir), f"--workdir={workdir}"


# A run that rotates its checkpoints (checkpoint.keep) may delete the step being read: the newest
# complete step that exists is tried again, this many times in all.
ROTATION_TRIES = 5
ROTATION_WAIT_S = 2.0  # how long a failed step is watched for its deletion to finish


def from_checkpoint(directory: str, flag: str, step: int | None, requested: dict, devices) -> Loaded:
    from jaxpar.checkpoint import CheckpointError
    from jaxpar.checkpoint.listing import finished_steps

    for _ in range(ROTATION_TRIES):
        steps = finished_steps(directory)
        if not steps:
            raise SampleError(f"{flag}: {directory} holds no complete checkpoint")
        if step is not None and step not in steps:
            raise SampleError(f"--step={step}: {directory} has no complete checkpoint of that step (steps: {steps})")
        chosen = steps[-1] if step is None else step
        try:
            return _load_step(directory, chosen, requested, devices)
        except CheckpointError:
            if not _rotated_away(directory, chosen):
                raise  # still there: damaged, not deleted
            if step is not None:
                raise SampleError(f"--step={step}: checkpoint {os.path.join(directory, str(step))} was deleted while it was "
                                  f"read (the run rotates its checkpoints: checkpoint.keep); choose a newer --step") from None
    raise SampleError(f"{flag}: every checkpoint tried in {directory} was deleted while it was read ({ROTATION_TRIES} tries); "
                      f"the run rotates its checkpoints faster than they can be read: raise its checkpoint.keep")


def _rotated_away(directory: str, step: int) -> bool:
    """Whether checkpoint `step` is (being) deleted: it leaves the complete steps within ROTATION_WAIT_S."""
    import time

    from jaxpar.checkpoint.listing import finished_steps

    deadline = time.monotonic() + ROTATION_WAIT_S
    while step in finished_steps(directory):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _load_step(directory: str, step: int, requested: dict, devices) -> Loaded:
    from jaxpar.checkpoint import Checkpoints, abstract_state
    from jaxpar.checkpoint.listing import saved_config
    from jaxpar.train.setup import build

    config = with_defaults(saved_config(directory, step))
    mesh = sampling_mesh(config.model, requested, dict(config.mesh), devices)
    config.mesh = ConfigDict(dict(mesh.shape))
    config.parallel.zero_stage, config.parallel.sequence_parallel, config.parallel.remat = 0, False, "none"
    program = build(config, list(mesh.devices.flat))
    with Checkpoints(directory, every_steps=0, read_only=True) as checkpoints:
        restored = checkpoints.restore(step, abstract_state(jax.eval_shape(program.init), program.state_shardings))
    params = restored.state.params
    if (adapters := lora.settings(program.model_config)) is not None:  # a LoRA run: the base with its adapters folded in
        params = jax.jit(lambda p: lora.merged(p, adapters, models.logical_axes(program.model_config)))(params)
    params = without_histories(params)  # delayed FP8 scaling's state steers training only
    sampler = Sampler(config.model, mesh, config.train.compute_dtype)
    tokenizer = run_tokenizer(config)
    return Loaded(config.model, sampler, sampler.place(params), tokenizer, eos_id(tokenizer),
                  f"checkpoint {_shown(restored.path)} (step {restored.step})")


def from_hf_dir(directory: str, requested: dict, devices) -> Loaded:
    from jaxpar.interop import hf, hf_core, sharded

    try:
        model = hf.model_config(directory)
    except (OSError, ValueError) as e:
        raise SampleError(f"--from_hf={directory}: {e}") from None
    mesh = sampling_mesh(model, requested, None, devices)
    if errors := sharded.problems(directory, model, key="--from_hf"):
        raise SampleError("\n".join(errors))
    sampler = Sampler(model, mesh)
    params = sharded.load_params_onto(directory, model, sampler.param_shardings(), "float32")
    has_tokenizer = any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES)
    tokenizer = tokenizer_at(directory) if has_tokenizer else None
    eos = eos_id(tokenizer, hf_core.read_config(directory).get("eos_token_id"))
    return Loaded(model, sampler, params, tokenizer, eos, f"transformers checkpoint {_shown(directory)}")


def _shown(path) -> str:
    """`path` as the user would type it: relative to the working directory when it lies inside it."""
    relative = os.path.relpath(os.fspath(path))
    return os.fspath(path) if relative.startswith("..") else relative
