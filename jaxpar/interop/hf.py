"""transformers (Hugging Face) checkpoints <-> jaxpar `(config.model, params)`.

`load(path)` reads a `save_pretrained` directory (config.json + model.safetensors, or an index and
shards) into a `config.model` ConfigDict and numpy float32 params; `save(path, model_config, params)`
writes one that `transformers.<Arch>ForCausalLM.from_pretrained` loads. The family's adapter
(its record in `jaxpar.models.families`) supplies the config converters and the layer table; the
family-independent work is in `jaxpar.interop.hf_core`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from jaxpar.interop import hf_core
from jaxpar.models import param_shapes
from jaxpar.models.families import FAMILIES


def _adapter(model_type) -> hf_core.Adapter:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (only {', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type].hf


def _leaf_shapes(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(params, cfg) -> None:
    """Raises unless `params` has exactly the leaves and shapes of the model `cfg` describes."""
    want, got = _leaf_shapes(param_shapes(cfg)), _leaf_shapes(params)
    keys = sorted(want.keys() | got.keys())
    bad = [f"{k}: {got.get(k)} (want {want.get(k)})" for k in keys if want.get(k) != got.get(k)]
    if bad:
        raise ValueError("params do not fit the model config: " + "; ".join(bad[:4]))


def load(path) -> tuple[ConfigDict, dict]:
    """(config.model, numpy float32 params) from a transformers checkpoint directory."""
    directory = os.fspath(path)
    hf_config = hf_core.read_config(directory)
    adapter = _adapter(hf_config.get("model_type"))
    cfg = adapter.to_model_config(hf_config)
    with hf_core.Checkpoint(directory) as get:
        params = hf_core.outer_from_hf(get, cfg)
        params["layers"] = hf_core.layers_from_hf(get, cfg, adapter.layer_table)
        # A tied checkpoint may still carry a copy of the embedding as lm_head; transformers drops it.
        extra = get.unread(ignored={"lm_head.weight"} if cfg.tie_word_embeddings else ())
    if extra:
        raise ValueError(f"{directory}: {len(extra)} tensors {adapter.hf_class} does not have, e.g. {extra[:3]}")
    _check_shapes(params, cfg)
    return cfg, params


def save(path, model_config, params) -> None:
    """Writes config.json + model.safetensors (float32) for `from_pretrained`; params: jax or numpy."""
    directory, cfg = os.fspath(path), model_config
    adapter = _adapter(cfg.model_type)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    _check_shapes(params, cfg)
    tensors = {**hf_core.outer_to_hf(params, cfg), **hf_core.layers_to_hf(params["layers"], cfg, adapter.layer_table)}
    os.makedirs(directory, exist_ok=True)
    tensors = {name: np.ascontiguousarray(w) for name, w in tensors.items()}
    save_file(tensors, os.path.join(directory, hf_core.WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config = dict(architectures=[adapter.hf_class], model_type=cfg.model_type, **adapter.to_hf_config(cfg))
    with open(os.path.join(directory, hf_core.CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
