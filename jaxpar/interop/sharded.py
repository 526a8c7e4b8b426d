"""transformers checkpoints read straight onto a mesh, and checked before a run starts.

`load_params_onto(directory, model_config, shardings, dtype)` builds every parameter as a global
jax.Array with `jax.make_array_from_callback`: each process is asked only for the blocks its own
devices hold, and each block is read from the safetensors files as a slice (safetensors' lazy
`get_slice` reads just those bytes of the memory-mapped file). So no host ever holds the whole
model, only its devices' share. The slice of a jaxpar leaf maps back to a slice of the HF tensor per
layout (transpose, heads split from rows or columns, vocab padding, experts stacked); the one layout
without a slice rule (Mixtral's fused gate_up) reads one layer's tensor and slices it.

`problems(directory, model_config)` is the preflight of `train.init_from_hf`: config.json parses
and matches `config.model`; every safetensors file opens (a truncated one does not); every tensor
the model needs is there with the right shape (headers only, no tensor data read). One line per
problem naming the file and tensor.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from jaxpar.config import DTYPES, head_dim_of, resolve_derived
from jaxpar.interop import hf, hf_core, hf_mixtral
from jaxpar.models import param_shapes
from jaxpar.models.families import FAMILIES

# config.model keys that do not change what the parameters mean.
IGNORED_KEYS = ("initializer_range",)


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    assert step == 1, index
    return start, stop


def _rows_cols(get, name: str, rows: tuple[int, int], cols: tuple[int, int] | None) -> np.ndarray:
    part = get.get_slice(name)
    block = part[rows[0] : rows[1]] if cols is None else part[rows[0] : rows[1], cols[0] : cols[1]]
    return np.asarray(block, np.float32)


def _heads(index: slice, heads: int, head_dim: int) -> tuple[int, int]:
    h0, h1 = _span(index, heads)
    return h0 * head_dim, h1 * head_dim


def _layout_slice(layout, get, name: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
    """The block `index` of one layer's jaxpar tensor of `shape`, read as a slice of HF tensor `name`."""
    dh = head_dim_of(cfg)
    if layout is hf_core.COPY:
        return _rows_cols(get, name, _span(index[0], shape[0]), None if len(shape) == 1 else _span(index[1], shape[1]))
    if layout is hf_core.LINEAR:  # jaxpar [in, out] = HF [out, in].T
        return _rows_cols(get, name, _span(index[1], shape[1]), _span(index[0], shape[0])).T
    if layout is hf_core.HEADS_IN:  # jaxpar [D, H, Dh] from HF rows h*Dh + e
        block = _rows_cols(get, name, _heads(index[1], shape[1], dh), _span(index[0], shape[0]))
        return block.T.reshape(block.shape[1], -1, dh)[:, :, index[2]]
    if layout is hf_core.HEADS_OUT:  # jaxpar [H, Dh, D] from HF columns h*Dh + e
        block = _rows_cols(get, name, _span(index[2], shape[2]), _heads(index[0], shape[0], dh))
        return block.T.reshape(-1, dh, block.shape[0])[:, index[1], :]
    raise ValueError(f"no slice rule for layout {layout}")


def _entry_slice(entry, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
    """The block `index` of one layer's value of a layer-table entry."""
    if isinstance(entry, hf_core.Weight):
        return _layout_slice(entry.layout, get, prefix + entry.hf, cfg, index, shape)
    if isinstance(entry, hf_mixtral.Router):
        name = prefix + (hf_mixtral.ROUTER if get.has(prefix + hf_mixtral.ROUTER) else hf_mixtral.FUSED_ROUTER)
        return _layout_slice(hf_core.LINEAR, get, name, cfg, index, shape)
    if isinstance(entry, hf_mixtral.ExpertStack) and get.has(prefix + hf_mixtral.PER_EXPERT.format(0, entry.hf_name)):
        e0, e1 = _span(index[0], shape[0])
        names = [prefix + hf_mixtral.PER_EXPERT.format(e, entry.hf_name) for e in range(e0, e1)]
        return np.stack([_layout_slice(hf_core.LINEAR, get, n, cfg, index[1:], shape[1:]) for n in names])
    return entry.read(get, prefix, cfg)[index]  # fused experts: one layer's tensor, then the block


def _vocab_rows(get, name: str, cfg, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Rows [r0, r1) of the padded [Vpad, D] table (rows past vocab_size are zeros)."""
    r0, r1 = rows
    real = _rows_cols(get, name, (min(r0, cfg.vocab_size), min(r1, cfg.vocab_size)), cols)
    return np.pad(real, ((0, (r1 - r0) - real.shape[0]), (0, 0)))


def _outer_slice(path: tuple, get, cfg, index: tuple, shape: tuple) -> np.ndarray:
    if path == ("embed", "weight"):
        return _vocab_rows(get, hf_core.EMBED, cfg, _span(index[0], shape[0]), _span(index[1], shape[1]))
    if path == ("lm_head", "weight"):  # jaxpar [D, Vpad] = padded HF [V, D].T
        return _vocab_rows(get, hf_core.LM_HEAD, cfg, _span(index[1], shape[1]), _span(index[0], shape[0])).T
    return _rows_cols(get, hf_core.FINAL_NORM, _span(index[0], shape[0]), None)


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
    table = FAMILIES[cfg.model_type].hf.layer_table
    shapes = param_shapes(cfg)
    leaves = {}
    with hf_core.Checkpoint(os.fspath(directory)) as get:
        for path, abstract in _paths(shapes):
            shape = tuple(abstract.shape)

            @functools.lru_cache(maxsize=None)  # replicated blocks are asked for once per device
            def block(key, path=path, shape=shape):
                index = tuple(slice(a, b) for a, b in key)
                if path[0] != "layers":
                    return _outer_slice(path, get, cfg, index, shape)
                l0, l1 = _span(index[0], shape[0])
                entry = table[path[1:]]
                parts = [_entry_slice(entry, get, hf_core.LAYER_PREFIX.format(i), cfg, index[1:], shape[1:]) for i in range(l0, l1)]
                return np.stack(parts)

            def callback(index, shape=shape, block=block):
                key = tuple(_span(s, n) for s, n in zip(index, shape))
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


def _expected_tensors(cfg) -> dict[str, tuple]:
    """HF tensor name -> shape for the model `cfg`, from shapes alone (nothing allocated)."""
    adapter, shapes = FAMILIES[cfg.model_type].hf, param_shapes(cfg)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), shapes)
    expected = {k: v.shape for k, v in jax.eval_shape(lambda p: hf_core.outer_to_hf(p, cfg), abstract).items()}
    layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), abstract["layers"])
    for i in range(cfg.num_hidden_layers):
        prefix = hf_core.LAYER_PREFIX.format(i)
        for path, entry in adapter.layer_table.items():
            written = jax.eval_shape(lambda leaf, e=entry, p=prefix: e.write(leaf, p, cfg), _at(layer, path))
            expected.update({name: s.shape for name, s in written.items()})
    return expected


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
        with hf_core.Checkpoint(directory) as get:
            found = {}
            for name in sorted(get.file_of):
                found[name] = tuple(get.get_slice(name).get_shape())
            file_of = dict(get.file_of)
    except (OSError, ValueError) as e:
        return [f"{flag}: {e}"]
    fused = any(".mlp.experts." in name for name in found)
    errors = []
    for name, shape in _expected_tensors(model_config).items():
        if name not in found:
            if not (fused and ".block_sparse_moe." in name):
                errors.append(f"{flag}: no tensor {name} in the checkpoint's safetensors files")
        elif found[name] != tuple(shape):
            errors.append(f"{file_of[name]}: tensor {name} has shape {list(found[name])}, config.model needs {list(shape)}")
    if errors and len(errors) > 3:
        errors = errors[:3] + [f"{flag}: ... and {len(errors) - 3} more tensor problems"]
    return errors


__all__ = ["load_params_onto", "problems"]
