"""The family-independent core of the transformers (Hugging Face) interop.

HF weights are [out, in] per layer; jaxpar stores [in, out] with heads split out, stacked over
layers on axis 0, vocab padded with zeros. Per-layer weights are mapped by a table (jaxpar path
-> entry that reads/writes one layer's HF tensors): each family's adapter (`hf_llama`,
`hf_mixtral`) supplies its table and config converters as an `Adapter`; this module supplies the
layouts, the config.json helpers both families use, the safetensors reading, and everything
outside the decoder layers. The public `load` / `save` are in `jaxpar.interop.hf`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors.numpy reads BF16)
import numpy as np
from ml_collections import ConfigDict
from safetensors import safe_open

from jaxpar.config import ROPE_TYPES, head_dim_of, llama_model_config, padded_vocab_size

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers.{}."
# Tensors some exports carry that hold no parameters (RoPE buffers of old transformers versions).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


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
            raise ValueError(f"{get.where(name)}: tensor {name} {w.shape} does not fit the model config: {e}") from None

    def write(self, w: np.ndarray, prefix: str, cfg) -> dict[str, np.ndarray]:
        return {prefix + self.hf: self.layout.to_hf(w, cfg)}


# ---- config.json <-> config.model ----


def field(d: dict, key: str):
    if d.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return d[key]


def reject_unsupported(hf: dict, supported: dict) -> None:
    """One-line error for a config.json key whose value jaxpar's model cannot represent."""
    for key, value in supported.items():
        if hf.get(key, value) != value:
            raise ValueError(f"config.json {key}={hf[key]!r} is not supported (only {value!r})")


def rope_from_hf(hf: dict, default_theta: float) -> tuple[float, dict]:
    """(rope_theta, rope_scaling) from either layout: transformers 5's `rope_parameters`, or Llama
    3.x's top-level `rope_theta` + `rope_scaling` (which transformers prefers when both exist)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
    scaling = llama_model_config().rope_scaling.to_dict()  # llama3 fields unused by "default"
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.update({key: float(field(rope, key)) for key in LLAMA3_FACTORS})
        # transformers' fallback when the checkpoint omits it.
        original = rope.get("original_max_position_embeddings") or field(hf, "max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling


def rope_to_hf(cfg) -> tuple[dict, dict | None]:
    """(rope_parameters, top-level rope_scaling) for config.json."""
    s = cfg.rope_scaling
    if s.rope_type == "default":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}, None
    scaling = {key: s[key] for key in ("rope_type", "original_max_position_embeddings") + LLAMA3_FACTORS}
    return {**scaling, "rope_theta": cfg.rope_theta}, scaling


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def decoder_model_fields(hf: dict, *, default_eps: float, default_theta: float) -> dict:
    """The `config.model` fields every decoder family shares (Llama's), from a config.json dict;
    `default_*`: the family's transformers defaults for keys the file omits."""
    sizes = {key: int(field(hf, key)) for key in REQUIRED_SIZES}
    theta, scaling = rope_from_hf(hf, default_theta)
    head_dim = hf.get("head_dim")
    return dict(
        **sizes,
        num_key_value_heads=int(hf.get("num_key_value_heads") or sizes["num_attention_heads"]),
        head_dim=None if head_dim is None else int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", default_eps)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )


def decoder_hf_fields(cfg) -> dict:
    """The config.json fields every decoder family shares, from `config.model`."""
    rope_parameters, legacy_scaling = rope_to_hf(cfg)
    copied = REQUIRED_SIZES + ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings")
    return dict(
        {key: cfg[key] for key in copied + ("tie_word_embeddings", "initializer_range")},
        head_dim=head_dim_of(cfg),
        hidden_act="silu",
        rope_parameters=rope_parameters,
        # transformers 4.x reads only these two; 5.x reads either layout (same values here).
        rope_theta=cfg.rope_theta,
        rope_scaling=legacy_scaling,
        torch_dtype="float32",
        dtype="float32",
    )


# Attention and the block's two norms: the part of a decoder layer every family shares.
ATTENTION_AND_NORMS = {
    ("input_norm", "weight"): Weight("input_layernorm.weight"),
    ("attention", "q"): Weight("self_attn.q_proj.weight", HEADS_IN),
    ("attention", "k"): Weight("self_attn.k_proj.weight", HEADS_IN),
    ("attention", "v"): Weight("self_attn.v_proj.weight", HEADS_IN),
    ("attention", "o"): Weight("self_attn.o_proj.weight", HEADS_OUT),
    ("post_attention_norm", "weight"): Weight("post_attention_layernorm.weight"),
}


@dataclass(frozen=True)
class Adapter:
    """What a family needs to read and write transformers checkpoints."""

    hf_class: str  # e.g. "LlamaForCausalLM"
    to_model_config: Callable[[dict], ConfigDict]  # config.json dict -> config.model
    to_hf_config: Callable[[ConfigDict], dict]  # config.model -> config.json fields
    layer_table: dict  # jaxpar path under params["layers"] -> entry with read(get, prefix, cfg) / write(w, prefix, cfg)


# ---- Reading checkpoint files ----


def read_config(directory: str) -> dict:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    file = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def _open(file: str):
    """safe_open with a one-line error naming the file (truncated files fail here: the header's
    offsets go past the end)."""
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the file is unusable either way
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{file} is not a readable safetensors file ({first})") from None


def _weight_map(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file; the single file wins over an index, as in transformers."""
    single, index = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.isfile(single):
        with _open(single) as f:
            return {name: single for name in f.keys()}
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE} (safetensors only)")
    try:
        with open(index) as f:
            files = {name: os.path.join(directory, shard) for name, shard in json.load(f)["weight_map"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
    missing = sorted(os.path.basename(p) for p in set(files.values()) if not os.path.isfile(p))
    if missing:
        raise FileNotFoundError(f"{directory}: shards named in {INDEX_FILE} are missing: {missing}")
    return files


class Checkpoint(contextlib.ExitStack):
    """`get(name)` -> float32 numpy tensor, opening each file once; records which names were read."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory, self.file_of = directory, _weight_map(directory)
        self.read, self._handles = set(), {}

    def _handle(self, name: str):
        if name not in self.file_of:
            raise ValueError(f"{self.directory}: checkpoint has no tensor {name!r}")
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = self.enter_context(_open(file))
        self.read.add(name)
        return self._handles[file]

    def __call__(self, name: str) -> np.ndarray:
        handle = self._handle(name)
        try:
            return handle.get_tensor(name).astype(np.float32)
        except Exception as e:  # noqa: BLE001 - a damaged file: name it and the tensor
            raise ValueError(f"{self.where(name)}: cannot read tensor {name} ({e})") from None

    def get_slice(self, name: str):
        """safetensors' lazy slice of `name`: indexing it reads only those bytes."""
        return self._handle(name).get_slice(name)

    def where(self, name: str) -> str:
        return self.file_of.get(name, self.directory)

    def has(self, name: str) -> bool:
        return name in self.file_of

    def unread(self, ignored=()) -> list[str]:
        skip = set(ignored) | self.read
        return sorted(n for n in self.file_of if n not in skip and not n.endswith(IGNORED_SUFFIXES))


# ---- Param trees ----


def _pad_vocab(w: np.ndarray, name: str, cfg, where: str) -> np.ndarray:
    """[vocab, D] -> [padded vocab, D] with zero rows."""
    if w.shape[0] != cfg.vocab_size:
        raise ValueError(f"{where}: tensor {name} has {w.shape[0]} rows but vocab_size is {cfg.vocab_size}")
    return np.pad(w, ((0, padded_vocab_size(cfg.vocab_size) - cfg.vocab_size), (0, 0)))


EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def outer_from_hf(get, cfg) -> dict:
    """Everything outside the decoder layers (shared by Llama and Mixtral)."""
    params = {
        "embed": {"weight": _pad_vocab(get(EMBED), EMBED, cfg, get.where(EMBED))},
        "final_norm": {"weight": get(FINAL_NORM)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": _pad_vocab(get(LM_HEAD), LM_HEAD, cfg, get.where(LM_HEAD)).T}
    return params


def outer_to_hf(params, cfg) -> dict:
    v = cfg.vocab_size  # strips the vocab padding
    tensors = {"model.embed_tokens.weight": params["embed"]["weight"][:v]}
    tensors["model.norm.weight"] = params["final_norm"]["weight"]
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = params["lm_head"]["weight"][:, :v].T
    return tensors


def layers_from_hf(get, cfg, table: dict) -> dict:
    layers = {}
    for path, entry in table.items():
        stacked = np.stack([entry.read(get, LAYER_PREFIX.format(i), cfg) for i in range(cfg.num_hidden_layers)])
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = stacked
    return layers


def layers_to_hf(layers, cfg, table: dict) -> dict:
    tensors = {}
    for path, entry in table.items():
        leaf = layers
        for key in path:
            leaf = leaf[key]
        for i in range(cfg.num_hidden_layers):
            tensors.update(entry.write(leaf[i], LAYER_PREFIX.format(i), cfg))
    return tensors
