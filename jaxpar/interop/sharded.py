"""transformers checkpoints read straight onto a mesh, and checked before a run starts.

`load_params_onto(directory, model_config, shardings, dtype)` builds every parameter as a global
jax.Array with `jax.make_array_from_callback`: each process is asked only for the blocks its own
devices hold, and each block is read from the safetensors files as a slice (safetensors' lazy
`get_slice` reads just those bytes of the memory-mapped file). So no host ever holds the whole
model, only its devices' share. The slice of a jaxpar leaf maps back to a slice of the HF tensor per
layout (transpose, heads split from rows or columns, vocab padding, experts stacked); the one layout
(each adapter entry's `read_block`: transpose, heads split from rows or columns, experts stacked,
or, for a fused tensor without a slice rule, one layer's tensor read and sliced).

`problems(directory, model_config)` is the preflight of `train.init_from_hf`: config.json parses
and matches `config.model`; every safetensors file opens (a truncated one does not); every tensor
the model needs is there with the right shape (headers only, no tensor data read). One line per
problem naming the file and tensor.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxpar.config import resolve_derived
from jaxpar.dtypes import DTYPES
from jaxpar.interop import hf, hf_core
from jaxpar.models import param_shapes
from jaxpar.models.families import FAMILIES
from jaxpar.models.hf_adapter import rows_cols, span

# config.model keys that do not change what the parameters mean.
IGNORED_KEYS = ("initializer_range",)


def _vocab_rows(get, name: str, cfg, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Rows [r0, r1) of the padded [Vpad, D] table (rows past vocab_size are zeros)."""
    r0, r1 = rows
    real = rows_cols(get, name, (min(r0, cfg.vocab_size), min(r1, cfg.vocab_size)), cols)
    return np.pad(real, ((0, (r1 - r0) - real.shape[0]), (0, 0)))


def _outer_slice(path: tuple, get, cfg, index: tuple, shape: tuple) -> np.ndarray:
    if path == ("embed", "weight"):
        return _vocab_rows(get, hf_core.EMBED, cfg, span(index[0], shape[0]), span(index[1], shape[1]))
    if path == ("lm_head", "weight"):  # jaxpar [D, Vpad] = padded HF [V, D].T
        return _vocab_rows(get, hf_core.LM_HEAD, cfg, span(index[1], shape[1]), span(index[0], shape[0])).T
    return rows_cols(get, hf_core.FINAL_NORM, span(index[0], shape[0]), None)


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,))
    else:
        yield prefix, tree


def load_params_onto(directory: str, model_config, shardings, dtype: str = "float32"):
    """Params of the transformers checkpoint in `directory` as global jax.Arrays on `shardings`
    (a params-shaped tree of shardings); this process reads only its devices' blocks."""
    cfg, out_dtype = model_config, DTYPES[dtype]
    stacks = {stack.key: stack for stack in FAMILIES[cfg.model_type].hf.layer_stacks(cfg)}
    shapes = param_shapes(cfg)
    leaves = {}
    with hf.checkpoint(directory, announce=True) as get:
        for path, abstract in _paths(shapes):
            shape = tuple(abstract.shape)

            @functools.cache  # replicated blocks are asked for once per device
            def block(key, path=path, shape=shape):
                index = tuple(slice(a, b) for a, b in key)
                if path[0] not in stacks:
                    return _outer_slice(path, get, cfg, index, shape)
                l0, l1 = span(index[0], shape[0])
                stack = stacks[path[0]]
                entry = stack.table[path[1:]]
                prefixes = [hf_core.LAYER_PREFIX.format(i) for i in stack.indices[l0:l1]]
                parts = [entry.read_block(get, prefix, cfg, index[1:], shape[1:]) for prefix in prefixes]
                return np.stack(parts)

            def callback(index, shape=shape, block=block):
                key = tuple(span(s, n) for s, n in zip(index, shape))
                return block(key).astype(out_dtype)

            leaves[path] = jax.make_array_from_callback(shape, _at(shardings, path), callback)
    params = {}
    for path, array in leaves.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    return params


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _expected_tensors(cfg) -> tuple[dict[str, tuple], list[list[dict]]]:
    """(HF tensor name -> shape outside the layers, and per layer entry its on-disk layouts:
    alternatives of {name: shape}, any one of which holds it), from shapes alone."""
    adapter, shapes = FAMILIES[cfg.model_type].hf, param_shapes(cfg)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), shapes)
    outer = {k: v.shape for k, v in jax.eval_shape(lambda p: hf_core.outer_to_hf(p, cfg), abstract).items()}
    layers = []
    for stack in adapter.layer_stacks(cfg):
        for i in stack.indices:
            prefix = hf_core.LAYER_PREFIX.format(i)
            for path, entry in stack.table.items():
                layers.append(entry.on_disk(prefix, cfg, tuple(_at(shapes[stack.key], path).shape[1:])))
    return outer, layers


def problems(directory: str, model_config, key: str = "train.init_from_hf") -> list[str]:
    """One line per reason `directory` cannot initialise the model `model_config` (module docstring)."""
    flag = f"{key}={directory}"
    try:
        saved = hf.model_config(directory)
    except (OSError, ValueError) as e:
        return [f"{flag}: {e}"]
    # Fields config.json cannot hold (Mixtral's router_z_loss_coef) are the config's; derived
    # defaults (head_dim None) are compared by their values.
    saved = resolve_derived({"model": hf.with_jaxpar_fields(saved, model_config).to_dict()})["model"]
    wanted = resolve_derived({"model": model_config.to_dict()})["model"]
    differing = sorted(k for k in saved.keys() | wanted.keys() if k not in IGNORED_KEYS and saved.get(k) != wanted.get(k))
    if differing:
        described = ", ".join(f"model.{k} (checkpoint {saved.get(k)!r}, config {wanted.get(k)!r})" for k in differing)
        return [f"{flag}: its config.json differs from config.model in {described}; set config.model to the checkpoint's"]
    try:
        with hf.checkpoint(directory) as get:
            found = {}
            for name in sorted(get.file_of):
                found[name] = tuple(get.get_slice(name).get_shape())
            file_of = dict(get.file_of)
    except (OSError, ValueError) as e:
        return [f"{flag}: {e}"]
    outer, layers = _expected_tensors(model_config)
    errors = []

    def check(expected: dict) -> list[str]:
        out = []
        for name, shape in expected.items():
            if name not in found:
                out.append(f"{flag}: no tensor {name} in the checkpoint's safetensors files")
            elif found[name] != tuple(shape):
                out.append(f"{file_of[name]}: tensor {name} has shape {list(found[name])}, config.model needs {list(shape)}")
        return out

    errors += check(outer)
    for alternatives in layers:
        # The first layout with any of its tensors present is the one the checkpoint uses.
        used = next((a for a in alternatives if any(name in found for name in a)), alternatives[0])
        errors += check(used)
    if errors and len(errors) > 3:
        errors = errors[:3] + [f"{flag}: ... and {len(errors) - 3} more tensor problems"]
    return errors


__all__ = ["load_params_onto", "problems"]
