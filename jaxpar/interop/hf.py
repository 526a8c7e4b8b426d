"""transformers (Hugging Face) checkpoints <-> jaxpar `(config.model, params)`.

`load(path)` reads a `save_pretrained` directory (config.json + model.safetensors, or an index and
shards) into a `config.model` ConfigDict and numpy float32 params (of a model that holds a family's
model inside, such as Gemma 3's multimodal one, that inner model: `Adapter.wrappers`, `checkpoint`);
`save(path, model_config, params)` writes one that `transformers.<Arch>ForCausalLM.from_pretrained`
loads (the family's model alone). The family's adapter (its record in `jaxpar.models.families`)
supplies the config converters and the layer table; the family-independent work is in
`jaxpar.interop.hf_core`. For models larger than one host's memory, `jaxpar.interop.sharded` reads
straight onto a mesh, and `save` streams: params may be global jax.Arrays on any mesh, fetched one
layer at a time into shards of at most `max_shard_bytes`.

Every error names the file (and the tensor) at fault. `save` refuses a non-empty directory unless
`overwrite=True`, which first removes an earlier checkpoint's config, index and shards there.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from jaxpar.config import resolve_derived
from jaxpar.interop import hf_core
from jaxpar.models import param_shapes
from jaxpar.models.families import FAMILIES
from jaxpar.models.hf_adapter import Adapter, Wrapper

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size ("5GB")
SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"
# What `save` writes tensors as (`--hf_dtype` of scripts/convert.py).
SAVED_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def _adapter(model_type, where: str = "config.json") -> Adapter:
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (only {', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type].hf


def _reader(hf_config: dict, where: str) -> tuple[Adapter, Wrapper | None]:
    """The adapter that reads a config.json, and the wrapper when the file is a model holding a
    family's model inside (`Adapter.wrappers`: Gemma 3's multimodal checkpoints)."""
    model_type = hf_config.get("model_type")
    wrapped = {w.model_type: (family.hf, w) for family in FAMILIES.values() for w in family.hf.wrappers}
    if model_type in FAMILIES or model_type not in wrapped:
        return _adapter(model_type, where), None
    return wrapped[model_type]


def _inner_config(hf_config: dict, wrapper: Wrapper | None, where: str) -> dict:
    if wrapper is None:
        return hf_config
    inner = hf_config.get(wrapper.config_key)
    if not isinstance(inner, dict):
        raise ValueError(f"{where}: model_type {wrapper.model_type!r} needs a {wrapper.config_key} object")
    return {**wrapper.defaults, **inner, **wrapper.overrides}


def checkpoint(path, announce: bool = False) -> hf_core.Checkpoint:
    """The tensor reader of a checkpoint directory; for a wrapped model (a multimodal Gemma 3),
    one that names the inner model's tensors as that model does and skips the rest, saying so on
    stderr in one line when `announce` (process 0 only)."""
    directory = os.fspath(path)
    hf_config = hf_core.read_config(directory)
    adapter, wrapper = _reader(hf_config, os.path.join(directory, hf_core.CONFIG_FILE))
    get = hf_core.Checkpoint(directory, wrapper)
    if announce and wrapper is not None and jax.process_index() == 0:
        parts = sorted({name.removeprefix("model.").split(".")[0] for name in get.skipped})
        print(f"{directory}: {wrapper.hf_class}: loading its text model ({hf_config[wrapper.config_key].get('model_type')}, "
              f"as {adapter.hf_class}); {len(get.skipped)} tensors of {', '.join(parts) or 'its other parts'} are not loaded",
              file=sys.stderr)
    return get


def _leaf_shapes(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(params, cfg) -> None:
    """Raises unless `params` has exactly the leaves and shapes of the model `cfg` describes."""
    want, got = _leaf_shapes(param_shapes(cfg)), _leaf_shapes(params)
    keys = sorted(want.keys() | got.keys())
    bad = [f"{k}: {got.get(k)} (want {want.get(k)})" for k in keys if want.get(k) != got.get(k)]
    if bad:
        raise ValueError("params do not fit the model config: " + "; ".join(bad[:4]))


def model_config(path) -> ConfigDict:
    """The `config.model` of a transformers checkpoint directory (reads only config.json)."""
    directory = os.fspath(path)
    hf_config = hf_core.read_config(directory)
    file = os.path.join(directory, hf_core.CONFIG_FILE)
    adapter, wrapper = _reader(hf_config, file)
    try:
        cfg = adapter.to_model_config(_inner_config(hf_config, wrapper, file))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{file}: {e}") from None
    if adapter.fit_to_tensors is None or not hf_core.has_weights(directory):
        return cfg
    with checkpoint(directory) as get:  # tensor names only (the index, or headers)
        return adapter.fit_to_tensors(cfg, set(get.file_of))


def with_jaxpar_fields(model: ConfigDict, config_model: ConfigDict) -> ConfigDict:
    """`model` (read from a config.json) with the fields config.json cannot carry — jaxpar's own,
    e.g. Mixtral's router_z_loss_coef and capacity_factor — taken from `config_model` of the same
    family. They are found as the fields a config.json round trip of `config_model` does not
    preserve (derived defaults resolved, so head_dim None is not one of them)."""
    if config_model.get("model_type") != model.model_type:
        return model
    adapter = _adapter(model.model_type)
    # Routing options transformers cannot express (loss-free balancing) would make to_hf_config
    # refuse; the round trip runs with transformers' values, so they count as jaxpar's own fields.
    expressible = ConfigDict(config_model.to_dict())
    for key, value in adapter.routing.items():
        if key in expressible:
            expressible[key] = value
    trip = resolve_derived({"model": adapter.to_model_config(adapter.to_hf_config(expressible)).to_dict()})["model"]
    mine = resolve_derived({"model": config_model.to_dict()})["model"]
    merged = ConfigDict(model.to_dict())
    for key in sorted(mine.keys() & trip.keys()):
        if mine[key] != trip[key]:
            merged[key] = config_model[key]
    return merged


def load(path) -> tuple[ConfigDict, dict]:
    """(config.model, numpy float32 params) from a transformers checkpoint directory."""
    directory = os.fspath(path)
    cfg = model_config(directory)
    adapter = FAMILIES[cfg.model_type].hf
    with checkpoint(directory, announce=True) as get:
        params = hf_core.outer_from_hf(get, cfg)
        for stack in adapter.layer_stacks(cfg):
            params[stack.key] = hf_core.layers_from_hf(get, cfg, stack.table, stack.indices)
        if adapter.copies is not None:
            hf_core.check_copies(get, adapter.copies(cfg))
        # A tied checkpoint may still carry a copy of the embedding as lm_head; transformers drops it.
        extra = get.unread(ignored={"lm_head.weight"} if cfg.tie_word_embeddings else ())
    if extra:
        raise ValueError(f"{directory}: {len(extra)} tensors {adapter.hf_class} does not have, e.g. {extra[:3]}")
    _check_shapes(params, cfg)
    return cfg, params


def _fetch(x) -> np.ndarray:
    """A whole array on the host of every process (a global array is gathered over processes)."""
    if isinstance(x, np.ndarray) or x.is_fully_addressable:
        return np.asarray(x, np.float32)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float32)


def _tensor_groups(params, cfg, adapter):
    """[(names and shapes, producer)] in file order: the outer tensors, then one group per layer;
    `producer()` computes that group's HF tensors (on device for jax params) only when called."""
    copies = {} if adapter.copies is None else adapter.copies(cfg)
    outer = lambda p: hf_core.with_copies(hf_core.outer_to_hf(p, cfg), copies)  # noqa: E731
    groups = [(outer, None, lambda: outer(params))]
    abstract = jax.eval_shape(lambda p: p, params)
    by_layer = {}
    for stack in adapter.layer_stacks(cfg):
        table, layers = stack.table, params[stack.key]
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), abstract[stack.key])
        for j, i in enumerate(stack.indices):
            prefix = hf_core.LAYER_PREFIX.format(i)

            def one_layer(layer, prefix=prefix, table=table):
                # A tensor two entries write is the sum of their parts (gpt-oss's gate and up: the
                # interleaved columns of one tensor, each written with zeros in the other's).
                tensors = {}
                for path, entry in table.items():
                    for name, w in entry.write(_at(layer, path), prefix, cfg).items():
                        tensors[name] = tensors[name] + w if name in tensors else w
                return tensors

            by_layer[i] = (one_layer, one, lambda j=j, f=one_layer, layers=layers: f(jax.tree.map(lambda x: x[j], layers)))
    groups += [by_layer[i] for i in sorted(by_layer)]  # HF layer order
    shapes = [jax.eval_shape(groups[0][0], abstract)] + [jax.eval_shape(f, one) for f, one, _ in groups[1:]]
    return [(s, producer) for s, (_, _, producer) in zip(shapes, groups)]


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _plan_shards(groups, max_shard_bytes: int, itemsize: int = 4) -> list[list[str]]:
    shards, current, size = [], [], 0
    for shapes, _ in groups:
        for name, s in shapes.items():
            nbytes = int(np.prod(s.shape)) * itemsize
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
    return shards + [current]


def _clear(directory: str) -> None:
    """Removes an earlier checkpoint's files (config, weights, index, shards); keeps anything else."""
    names = [hf_core.CONFIG_FILE, hf_core.WEIGHTS_FILE, hf_core.INDEX_FILE]
    stale = [os.path.join(directory, n) for n in names] + glob.glob(os.path.join(directory, "model-*-of-*.safetensors"))
    for file in stale:
        if os.path.isfile(file):
            os.remove(file)


def hf_config(model_config) -> dict:
    """The transformers config.json of a jaxpar model config (what `save` writes beside the weights)."""
    adapter = _adapter(model_config.model_type)
    return dict(architectures=[adapter.hf_class], model_type=model_config.model_type, **adapter.to_hf_config(model_config))


def save(path, model_config, params, *, overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
         dtype: str = "float32") -> None:
    """Writes config.json + safetensors for `from_pretrained`: one model.safetensors, or shards of
    at most `max_shard_bytes` with an index. `params`: numpy, or jax.Arrays on any mesh (every
    process must call; process 0 writes). `dtype`: one of `SAVED_DTYPES`, float32 (exact) or
    bfloat16 (each value rounded to nearest even, as the released checkpoints hold them)."""
    if dtype not in SAVED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(SAVED_DTYPES)}")
    directory, cfg = os.fspath(path), model_config
    adapter = _adapter(cfg.model_type)
    _check_shapes(params, cfg)
    if os.path.isfile(directory):
        raise FileExistsError(f"{directory} is a file; save into a directory")
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise FileExistsError(f"{directory} is not empty; pass overwrite=True (convert.py --overwrite) to replace the checkpoint in it")
    hf_json = hf_config(cfg)  # a model transformers cannot express is refused here, before anything is written
    hf_json.update({key: dtype for key in ("torch_dtype", "dtype") if key in hf_json})
    saved = SAVED_DTYPES[dtype]
    groups = _tensor_groups(params, cfg, adapter)
    shards = _plan_shards(groups, max_shard_bytes, np.dtype(saved).itemsize)
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(directory, exist_ok=True)
        _clear(directory)
    files = [hf_core.WEIGHTS_FILE] if len(shards) == 1 else [SHARD_FILE.format(i + 1, len(shards)) for i in range(len(shards))]
    file_of = {name: file for names, file in zip(shards, files) for name in names}
    pending: dict[str, dict] = {file: {} for file in files}
    left = {file: len(names) for names, file in zip(shards, files)}
    total = 0
    for _, producer in groups:  # one group (a layer) on the host at a time, plus the shard being filled
        for name, w in producer().items():
            array = np.ascontiguousarray(_fetch(w).astype(saved, copy=False))
            total += array.nbytes
            file = file_of[name]
            pending[file][name] = array
            left[file] -= 1
            if left[file] == 0:
                if writer:
                    save_file(pending[file], os.path.join(directory, file), metadata={"format": "pt"})
                pending[file] = {}
    if not writer:
        return
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        with open(os.path.join(directory, hf_core.INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(directory, hf_core.CONFIG_FILE), "w") as f:
        json.dump(hf_json, f, indent=2, sort_keys=True)
