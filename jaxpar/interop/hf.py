"""transformers (Hugging Face) checkpoints <-> jaxpar `(config.model, params)`.

`load(path)` reads a `save_pretrained` directory (config.json + model.safetensors, or an index and
shards) into a `config.model` ConfigDict and numpy float32 params; `save(path, model_config, params)`
writes one that `transformers.<Arch>ForCausalLM.from_pretrained` loads.

HF weights are [out, in] per layer; jaxpar stores [in, out] with heads split out, stacked over layers
on axis 0, vocab padded with zeros. Per-layer weights are mapped by a table (jaxpar path -> entry
that reads/writes one layer's HF tensors), so a new architecture adds a table, two config converters
and an `ARCHITECTURES` row: `hf_mixtral` does exactly that for Mixtral (LLAMA_ATTENTION plus entries
for the router and the stacked experts, in both on-disk layouts) and registers itself below.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors.numpy reads BF16)
import numpy as np
from ml_collections import ConfigDict
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpar.config import llama_model_config
from jaxpar.models import param_shapes
from jaxpar.models.layers import head_dim_of, padded_vocab_size

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers.{}."
# Tensors some exports carry that hold no parameters (RoPE buffers of old transformers versions).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")
REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class Layout:
    """One layer's HF tensor -> its jaxpar slice and back, each `(array, cfg) -> array`."""

    to_jax: Callable
    to_hf: Callable


COPY = Layout(lambda w, cfg: w, lambda w, cfg: w)
LINEAR = Layout(lambda w, cfg: w.T, lambda w, cfg: w.T)  # [out, in] <-> [in, out]
# q/k/v: [heads * Dh, D] <-> [D, heads, Dh]
HEADS_IN = Layout(
    lambda w, cfg: w.T.reshape(w.shape[1], -1, head_dim_of(cfg)), lambda w, cfg: w.reshape(w.shape[0], -1).T
)
# o: [D, H * Dh] <-> [H, Dh, D]
HEADS_OUT = Layout(
    lambda w, cfg: w.T.reshape(-1, head_dim_of(cfg), w.shape[0]), lambda w, cfg: w.reshape(-1, w.shape[-1]).T
)


@dataclass(frozen=True)
class Weight:
    """One HF tensor per layer (`model.layers.{i}.` + `hf`) <-> one layer's slice of a jaxpar leaf."""

    hf: str
    layout: Layout = COPY

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        name = prefix + self.hf
        w = get(name)
        try:
            return self.layout.to_jax(w, cfg)
        except ValueError as e:  # a reshape that the config's head sizes do not fit
            raise ValueError(f"{name} {w.shape} does not fit the model config: {e}") from None

    def write(self, w: np.ndarray, prefix: str, cfg) -> dict[str, np.ndarray]:
        return {prefix + self.hf: self.layout.to_hf(w, cfg)}


# Attention and the block's two norms: the part of a decoder layer Mixtral shares with Llama.
LLAMA_ATTENTION = {
    ("input_norm", "weight"): Weight("input_layernorm.weight"),
    ("attention", "q"): Weight("self_attn.q_proj.weight", HEADS_IN),
    ("attention", "k"): Weight("self_attn.k_proj.weight", HEADS_IN),
    ("attention", "v"): Weight("self_attn.v_proj.weight", HEADS_IN),
    ("attention", "o"): Weight("self_attn.o_proj.weight", HEADS_OUT),
    ("post_attention_norm", "weight"): Weight("post_attention_layernorm.weight"),
}
LLAMA_MLP = {
    ("mlp", "gate"): Weight("mlp.gate_proj.weight", LINEAR),
    ("mlp", "up"): Weight("mlp.up_proj.weight", LINEAR),
    ("mlp", "down"): Weight("mlp.down_proj.weight", LINEAR),
}
LLAMA_LAYER = {**LLAMA_ATTENTION, **LLAMA_MLP}


# ---- config.json <-> config.model ----


def _field(d: dict, key: str):
    if d.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return d[key]


def _reject_unsupported(hf: dict) -> None:
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, supported) != supported:
            raise ValueError(f"config.json {key}={hf[key]!r} is not supported (only {supported!r})")


def _rope_from_hf(hf: dict) -> tuple[float, dict]:
    """(rope_theta, rope_scaling) from either layout: transformers 5's `rope_parameters`, or Llama
    3.x's top-level `rope_theta` + `rope_scaling` (which transformers prefers when both exist)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)})")
    scaling = llama_model_config().rope_scaling.to_dict()  # llama3 fields unused by "default"
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.update({key: float(_field(rope, key)) for key in LLAMA3_FACTORS})
        # transformers' fallback when the checkpoint omits it.
        original = rope.get("original_max_position_embeddings") or _field(hf, "max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling


def _rope_to_hf(cfg) -> tuple[dict, dict | None]:
    """(rope_parameters, top-level rope_scaling) for config.json."""
    s = cfg.rope_scaling
    if s.rope_type == "default":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}, None
    scaling = {key: s[key] for key in ("rope_type", "original_max_position_embeddings") + LLAMA3_FACTORS}
    return {**scaling, "rope_theta": cfg.rope_theta}, scaling


def _llama_model_config(hf: dict) -> ConfigDict:
    _reject_unsupported(hf)
    sizes = {key: int(_field(hf, key)) for key in REQUIRED_SIZES}
    theta, scaling = _rope_from_hf(hf)
    head_dim = hf.get("head_dim")
    return llama_model_config(
        **sizes,
        num_key_value_heads=int(hf.get("num_key_value_heads") or sizes["num_attention_heads"]),
        head_dim=None if head_dim is None else int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )


def _llama_hf_config(cfg) -> dict:
    rope_parameters, legacy_scaling = _rope_to_hf(cfg)
    copied = REQUIRED_SIZES + ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings")
    return dict(
        {key: cfg[key] for key in copied + ("tie_word_embeddings", "initializer_range")},
        head_dim=head_dim_of(cfg),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rope_parameters=rope_parameters,
        # transformers 4.x reads only these two; 5.x reads either layout (same values here).
        rope_theta=cfg.rope_theta,
        rope_scaling=legacy_scaling,
        torch_dtype="float32",
        dtype="float32",
    )


@dataclass(frozen=True)
class Architecture:
    hf_class: str
    to_model_config: Callable[[dict], ConfigDict]  # config.json dict -> config.model
    to_hf_config: Callable[[ConfigDict], dict]  # config.model -> config.json fields
    layer_table: dict  # jaxpar path under params["layers"] -> Weight-like entry


ARCHITECTURES = {"llama": Architecture("LlamaForCausalLM", _llama_model_config, _llama_hf_config, LLAMA_LAYER)}


def _architecture(model_type) -> Architecture:
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"model_type {model_type!r} is not supported (only {supported})")
    return ARCHITECTURES[model_type]


# ---- Reading checkpoint files ----


def _read_config(directory: str) -> dict:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    file = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
    with open(file) as f:
        return json.load(f)


def _weight_map(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file; the single file wins over an index, as in transformers."""
    single, index = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE} (safetensors only)")
    with open(index) as f:
        files = {name: os.path.join(directory, shard) for name, shard in json.load(f)["weight_map"].items()}
    missing = sorted(os.path.basename(p) for p in set(files.values()) if not os.path.isfile(p))
    if missing:
        raise FileNotFoundError(f"{directory}: shards named in {INDEX_FILE} are missing: {missing}")
    return files


class _Checkpoint(contextlib.ExitStack):
    """`get(name)` -> float32 numpy tensor, opening each file once; records which names were read."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory, self.file_of = directory, _weight_map(directory)
        self.read, self._handles = set(), {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.file_of:
            raise ValueError(f"{self.directory}: checkpoint has no tensor {name!r}")
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = self.enter_context(safe_open(file, framework="numpy"))
        self.read.add(name)
        return self._handles[file].get_tensor(name).astype(np.float32)

    def unread(self, ignored=()) -> list[str]:
        skip = set(ignored) | self.read
        return sorted(n for n in self.file_of if n not in skip and not n.endswith(IGNORED_SUFFIXES))


# ---- Param trees ----


def _pad_vocab(w: np.ndarray, name: str, cfg) -> np.ndarray:
    """[vocab, D] -> [padded vocab, D] with zero rows."""
    if w.shape[0] != cfg.vocab_size:
        raise ValueError(f"{name} has {w.shape[0]} rows but vocab_size is {cfg.vocab_size}")
    return np.pad(w, ((0, padded_vocab_size(cfg.vocab_size) - cfg.vocab_size), (0, 0)))


def _outer_from_hf(get, cfg) -> dict:
    """Everything outside the decoder layers (shared by Llama and Mixtral)."""
    params = {
        "embed": {"weight": _pad_vocab(get("model.embed_tokens.weight"), "model.embed_tokens.weight", cfg)},
        "final_norm": {"weight": get("model.norm.weight")},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": _pad_vocab(get("lm_head.weight"), "lm_head.weight", cfg).T}
    return params


def _outer_to_hf(params, cfg) -> dict:
    v = cfg.vocab_size  # strips the vocab padding
    tensors = {"model.embed_tokens.weight": params["embed"]["weight"][:v]}
    tensors["model.norm.weight"] = params["final_norm"]["weight"]
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = params["lm_head"]["weight"][:, :v].T
    return tensors


def _layers_from_hf(get, cfg, table: dict) -> dict:
    layers = {}
    for path, entry in table.items():
        stacked = np.stack([entry.read(get, LAYER_PREFIX.format(i), cfg) for i in range(cfg.num_hidden_layers)])
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = stacked
    return layers


def _layers_to_hf(layers, cfg, table: dict) -> dict:
    tensors = {}
    for path, entry in table.items():
        leaf = layers
        for key in path:
            leaf = leaf[key]
        for i in range(cfg.num_hidden_layers):
            tensors.update(entry.write(leaf[i], LAYER_PREFIX.format(i), cfg))
    return tensors


def _leaf_shapes(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(params, cfg) -> None:
    """Raises unless `params` has exactly the leaves and shapes of the model `cfg` describes."""
    want, got = _leaf_shapes(param_shapes(cfg)), _leaf_shapes(params)
    keys = sorted(want.keys() | got.keys())
    bad = [f"{k}: {got.get(k)} (want {want.get(k)})" for k in keys if want.get(k) != got.get(k)]
    if bad:
        raise ValueError("params do not fit the model config: " + "; ".join(bad[:4]))


# ---- Public API ----


def load(path) -> tuple[ConfigDict, dict]:
    """(config.model, numpy float32 params) from a transformers checkpoint directory."""
    directory = os.fspath(path)
    hf_config = _read_config(directory)
    arch = _architecture(hf_config.get("model_type"))
    cfg = arch.to_model_config(hf_config)
    with _Checkpoint(directory) as get:
        params = _outer_from_hf(get, cfg)
        params["layers"] = _layers_from_hf(get, cfg, arch.layer_table)
        # A tied checkpoint may still carry a copy of the embedding as lm_head; transformers drops it.
        extra = get.unread(ignored={"lm_head.weight"} if cfg.tie_word_embeddings else ())
    if extra:
        raise ValueError(f"{directory}: {len(extra)} tensors {arch.hf_class} does not have, e.g. {extra[:3]}")
    _check_shapes(params, cfg)
    return cfg, params


def save(path, model_config, params) -> None:
    """Writes config.json + model.safetensors (float32) for `from_pretrained`; params: jax or numpy."""
    directory, cfg = os.fspath(path), model_config
    arch = _architecture(cfg.model_type)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    _check_shapes(params, cfg)
    tensors = {**_outer_to_hf(params, cfg), **_layers_to_hf(params["layers"], cfg, arch.layer_table)}
    os.makedirs(directory, exist_ok=True)
    tensors = {name: np.ascontiguousarray(w) for name, w in tensors.items()}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config = dict(architectures=[arch.hf_class], model_type=cfg.model_type, **arch.to_hf_config(cfg))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)


# Architectures defined in their own modules register themselves in ARCHITECTURES.
from jaxpar.interop import hf_mixtral  # noqa: E402,F401
