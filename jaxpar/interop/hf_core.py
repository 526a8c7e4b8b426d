"""The family-independent core of the transformers (Hugging Face) interop: files and the tensors
outside the decoder layers.

Per-layer weights are mapped by the family's adapter (`jaxpar/models/<family>/hf.py`, written with
`jaxpar.models.hf_adapter`): a table from jaxpar path to an entry that reads and writes one layer's
HF tensors. This module reads config.json and safetensors files (`Checkpoint`: the `get` every
entry reads through), converts the embedding, final norm and LM head (vocab padded with zeros),
and stacks the layers. The public `load` / `save` are in `jaxpar.interop.hf`.
"""

from __future__ import annotations

import contextlib
import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors.numpy reads BF16)
import numpy as np
from safetensors import safe_open

from jaxpar.model_facts import padded_vocab_size

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers.{}."
# Tensors some exports carry that hold no parameters (RoPE buffers of old transformers versions).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def has_weights(directory: str) -> bool:
    """The directory holds safetensors weights (a single file or an index), not only a config."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in (WEIGHTS_FILE, INDEX_FILE))


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
    """`get(name)` -> float32 numpy tensor, opening each file once; records which names were read.

    `wrapper` (`jaxpar.models.hf_adapter.Wrapper`, a model holding the family's model inside):
    tensors are named as the inner model names them, and those of the wrapper's other parts are
    left out (`skipped` lists them)."""

    def __init__(self, directory: str, wrapper=None):
        super().__init__()
        self.directory, self.file_of = directory, _weight_map(directory)
        self.read, self._handles, self._stored, self.skipped = set(), {}, {}, []
        if wrapper is not None:
            self.file_of = self._unwrapped(wrapper)

    def _unwrapped(self, wrapper) -> dict[str, str]:
        file_of = {}
        for name, file in self.file_of.items():
            if name.startswith(wrapper.ignored):
                self.skipped.append(name)
                continue
            inner = next((new + name[len(old):] for old, new in wrapper.renamed.items() if name.startswith(old)), name)
            file_of[inner], self._stored[inner] = file, name
        return file_of

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
            return handle.get_tensor(self._stored.get(name, name)).astype(np.float32)
        except Exception as e:  # noqa: BLE001 - a damaged file: name it and the tensor
            raise ValueError(f"{self.where(name)}: cannot read tensor {name} ({e})") from None

    def get_slice(self, name: str):
        """safetensors' lazy slice of `name`: indexing it reads only those bytes."""
        return self._handle(name).get_slice(self._stored.get(name, name))

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


def with_copies(tensors: dict, copies: dict) -> dict:
    """`tensors` and the copies a format repeats ({copy name: source name}) of those among them;
    a copy of a tensor the model has not (a tied model's lm_head) copies the embedding."""
    repeated = {name: tensors.get(source, tensors[EMBED]) for name, source in copies.items()}
    return {**tensors, **repeated}


def check_copies(get, copies: dict) -> None:
    """Reads the copies present in the checkpoint and raises unless each equals its source."""
    for name, source in copies.items():
        if not get.has(name):
            continue
        source = source if get.has(source) else EMBED
        if not np.array_equal(get(name), get(source)):
            raise ValueError(f"{get.where(name)}: tensor {name} differs from {source}, which it must repeat")


def layers_from_hf(get, cfg, table: dict, indices) -> dict:
    """One layer stack: `table`'s entries of the HF layers `indices`, stacked in that order."""
    layers = {}
    for path, entry in table.items():
        stacked = np.stack([entry.read(get, LAYER_PREFIX.format(i), cfg) for i in indices])
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = stacked
    return layers
