"""The sampling mesh, the tokenizer of a run, and `Loaded`: what a sampler needs besides its programs.

Loading them from a run's checkpoint, a checkpoint directory or a transformers directory is
`jaxpar.loading` (restoring a checkpoint builds the train program, a layer above sampling).

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


def tokenizer_at(path: str):
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
        return tokenizer_at(data.tokenizer)
    if data.get("source") in TEXT_SOURCES:
        return ByteTokenizer()
    sidecar = sidecar_path(data.get("path", "")) if data.get("path") else ""
    if sidecar and os.path.exists(sidecar):
        with open(sidecar) as f:
            path = json.load(f).get("tokenizer")
        if path and os.path.isdir(path):
            return tokenizer_at(path)
    return None


def eos_id(tokenizer, fallback=None):
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = fallback
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos
