"""Where the sampler's weights and tokenizer come from, restored onto the sampling mesh.

A run's checkpoint (`--workdir`, its newest complete step or `--step`), a checkpoint directory
(`scripts/convert.py --to_checkpoint`, or a run's `checkpoints/`), or a transformers directory
(`--from_hf`). Checkpoints are restored as resume does: the saved config's train state laid out
for the sampling mesh (ZeRO off, sequence parallelism off), so a checkpoint saved on one mesh
samples on any other; each process reads only the shards its devices hold. The whole train state
is read (params and optimizer state, as resume needs it); only the params are kept.

The sampling mesh: `tensor` and `expert` as given, else as the run trained (when they divide the
devices), `data` the rest. Tokenizer: a run on a byte corpus (`data.source` stdlib / text) decodes
bytes; a run on a token file decodes with the transformers tokenizer its sidecar names
(`scripts/prepare_data.py`); a transformers directory with tokenizer files uses them. EOS: the
tokenizer's, else config.json's `eos_token_id`, else none.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import jax
from ml_collections import ConfigDict

from jaxpar.axes import DATA, EXPERT, MESH_AXES, TENSOR
from jaxpar.mesh import MeshError, make_mesh, resolve_mesh_shape
from jaxpar.sampling.engine import SampleError, Sampler, mesh_problems

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Loaded:
    model_config: ConfigDict
    sampler: Sampler
    params: object  # placed on the sampler's mesh
    tokenizer: object | None  # encode(text) -> ids / decode(ids) -> text; None: ids only
    eos_id: int | None
    source: str  # what was loaded, for the first line printed


def sampling_mesh(model_config, requested: dict, trained: dict | None, devices):
    """The mesh: explicit sizes (> 0) win; tensor / expert default to the run's; data takes the rest.
    When `data` is given too, only the devices the sizes multiply to are used. What the model
    cannot use is refused before the sizes are fitted to the devices (it names the model key)."""
    sizes = {axis: 1 for axis in MESH_AXES}
    for axis in (TENSOR, EXPERT):
        size = int((trained or {}).get(axis, 1))
        if size > 1 and len(devices) % size == 0 and not mesh_problems(model_config, {**sizes, axis: size}):
            sizes[axis] = size
    sizes.update({axis: size for axis, size in requested.items() if size})
    if errors := mesh_problems(model_config, sizes, prefix="--"):
        raise SampleError("\n".join(errors))
    if requested.get(DATA):
        used = math.prod(sizes.values())
        if used > len(devices):
            raise MeshError(f"the mesh {describe(sizes)} needs {used} devices but {len(devices)} are available")
        devices = devices[:used]
    else:
        sizes[DATA] = -1
    return make_mesh(resolve_mesh_shape(sizes, len(devices)), devices)


def describe(sizes: dict) -> str:
    return " ".join(f"{axis}={size}" for axis, size in sizes.items())


def _tokenizer_at(path: str):
    from jaxpar.data.prepare import PrepareError, load_tokenizer

    try:
        return load_tokenizer(path)
    except PrepareError as e:
        raise SampleError(str(e).replace("--tokenizer=", "tokenizer ")) from None


def run_tokenizer(config):
    """The tokenizer a run trained with (module docstring), or None when unknown."""
    from jaxpar.data import ByteTokenizer
    from jaxpar.data.sources import TEXT_SOURCES, sidecar_path

    data = config.data
    if data.get("tokenizer") and os.path.isdir(data.tokenizer):  # text read through a transformers tokenizer
        return _tokenizer_at(data.tokenizer)
    if data.get("source") in TEXT_SOURCES:
        return ByteTokenizer()
    sidecar = sidecar_path(data.get("path", "")) if data.get("path") else ""
    if sidecar and os.path.exists(sidecar):
        with open(sidecar) as f:
            path = json.load(f).get("tokenizer")
        if path and os.path.isdir(path):
            return _tokenizer_at(path)
    return None


def _eos(tokenizer, fallback=None):
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = fallback
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


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

    config = ConfigDict(saved_config(directory, step))
    mesh = sampling_mesh(config.model, requested, dict(config.mesh), devices)
    config.mesh = ConfigDict(dict(mesh.shape))
    config.parallel.zero_stage, config.parallel.sequence_parallel, config.parallel.remat = 0, False, "none"
    program = build(config, list(mesh.devices.flat))
    with Checkpoints(directory, every_steps=0, read_only=True) as checkpoints:
        restored = checkpoints.restore(step, abstract_state(jax.eval_shape(program.init), program.state_shardings))
    sampler = Sampler(config.model, mesh, config.train.compute_dtype)
    tokenizer = run_tokenizer(config)
    return Loaded(config.model, sampler, sampler.place(restored.state.params), tokenizer, _eos(tokenizer),
                  f"checkpoint {_shown(restored.path)} (step {restored.step})")


def from_hf(directory: str, requested: dict, devices) -> Loaded:
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
    tokenizer = _tokenizer_at(directory) if has_tokenizer else None
    eos = _eos(tokenizer, hf_core.read_config(directory).get("eos_token_id"))
    return Loaded(model, sampler, params, tokenizer, eos, f"transformers checkpoint {_shown(directory)}")


def _shown(path) -> str:
    """`path` as the user would type it: relative to the working directory when it lies inside it."""
    relative = os.path.relpath(os.fspath(path))
    return os.fspath(path) if relative.startswith("..") else relative
