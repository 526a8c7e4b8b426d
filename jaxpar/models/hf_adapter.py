"""The toolkit a family's transformers (Hugging Face) adapter is written with.

HF weights are [out, in] per layer; jaxpar stores [in, out] with heads split out, stacked over
layers on axis 0. A family's adapter (`jaxpar/models/<family>/hf.py`) is an `Adapter`: its config
converters and a layer table mapping each jaxpar path under `params["layers"]` to an entry that
reads and writes one layer's HF tensors. Every entry has the same four methods:

  read(get, prefix, cfg) -> array          one layer's jaxpar value (numpy)
  write(w, prefix, cfg) -> {name: array}   the HF tensors of one layer's value
  read_block(get, prefix, cfg, index, shape) -> array
                                           the block `index` of one layer's value of `shape`, read
                                           as slices of the HF tensors (`jaxpar.interop.sharded`:
                                           each process reads only its devices' blocks)
  on_disk(prefix, cfg, shape) -> [{name: shape}, ...]
                                           the on-disk layouts that hold one layer's value, the one
                                           `write` produces first (preflight checks headers against them)

`get` is a checkpoint reader (`jaxpar.interop.hf_core.Checkpoint`): `get(name)`, `get.get_slice(name)`,
`get.has(name)`, `get.where(name)`. The file reading, the tensors outside the decoder layers and the
public `load` / `save` are in `jaxpar.interop`.

A model with two layer stacks (dense layers among MoE layers, `jaxpar.models.decoder`) names them
with `Adapter.stacks`: per stack its params key, the HF layer indices it holds, and its table.
Routed experts are `ExpertStack` entries (per-expert tensors, or transformers 5's fused in-memory
layout), shared by the MoE families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np
from ml_collections import ConfigDict

from jaxpar.model_facts import head_dim_of
from jaxpar.models.schema import ROPE_TYPES, decoder_config

LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


# ---- blocks of HF tensors ----


def span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    assert step == 1, index
    return start, stop


def rows_cols(get, name: str, rows: tuple[int, int], cols: tuple[int, int] | None) -> np.ndarray:
    part = get.get_slice(name)
    block = part[rows[0] : rows[1]] if cols is None else part[rows[0] : rows[1], cols[0] : cols[1]]
    return np.asarray(block, np.float32)


def _heads(index: slice, heads: int, head_dim: int) -> tuple[int, int]:
    h0, h1 = span(index, heads)
    return h0 * head_dim, h1 * head_dim


@dataclass(frozen=True)
class Layout:
    """One HF tensor <-> one layer's jaxpar value: each `(array, cfg) -> array`, and `block(get, name,
    cfg, index, shape)` reading the jaxpar block `index` (of a value of `shape`) as a slice."""

    to_jax: Callable
    to_hf: Callable
    block: Callable
    to_hf_shape: Callable  # (jaxpar shape, cfg) -> HF shape


def _copy_block(get, name, cfg, index, shape):
    return rows_cols(get, name, span(index[0], shape[0]), None if len(shape) == 1 else span(index[1], shape[1]))


def _linear_block(get, name, cfg, index, shape):  # jaxpar [in, out] = HF [out, in].T
    return rows_cols(get, name, span(index[1], shape[1]), span(index[0], shape[0])).T


def _heads_in_block(get, name, cfg, index, shape):  # jaxpar [D, H, Dh] from HF rows h*Dh + e
    dh = shape[2]
    block = rows_cols(get, name, _heads(index[1], shape[1], dh), span(index[0], shape[0]))
    return block.T.reshape(block.shape[1], -1, dh)[:, :, index[2]]


def _heads_out_block(get, name, cfg, index, shape):  # jaxpar [H, Dh, D] from HF columns h*Dh + e
    dh = shape[1]
    block = rows_cols(get, name, span(index[2], shape[2]), _heads(index[0], shape[0], dh))
    return block.T.reshape(-1, dh, block.shape[0])[:, index[1], :]


COPY = Layout(lambda w, cfg: w, lambda w, cfg: w, _copy_block, lambda s, cfg: tuple(s))
LINEAR = Layout(lambda w, cfg: w.T, lambda w, cfg: w.T, _linear_block, lambda s, cfg: tuple(reversed(s)))


def heads_in(head_dim: Callable = head_dim_of) -> Layout:
    """An input projection with heads: HF [heads * Dh, in] <-> jaxpar [in, heads, Dh], Dh = head_dim(cfg)."""
    return Layout(
        lambda w, cfg: w.T.reshape(w.shape[1], -1, head_dim(cfg)), lambda w, cfg: w.reshape(w.shape[0], -1).T,
        _heads_in_block, lambda s, cfg: (s[1] * s[2], s[0]),
    )


def heads_out(head_dim: Callable = head_dim_of) -> Layout:
    """An output projection with heads: HF [out, heads * Dh] <-> jaxpar [heads, Dh, out]."""
    return Layout(
        lambda w, cfg: w.T.reshape(-1, head_dim(cfg), w.shape[0]), lambda w, cfg: w.reshape(-1, w.shape[-1]).T,
        _heads_out_block, lambda s, cfg: (s[2], s[0] * s[1]),
    )


HEADS_IN = heads_in()  # q/k/v: [heads * Dh, D] <-> [D, heads, Dh]
HEADS_OUT = heads_out()  # o: [D, H * Dh] <-> [H, Dh, D]


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

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        return self.layout.block(get, prefix + self.hf, cfg, index, shape)

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        return [{prefix + self.hf: self.layout.to_hf_shape(shape, cfg)}]


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


# jaxpar's MoE router options that change what a model computes, with the value transformers'
# MoE families (softmax top-k, no selection bias) have.
TRANSFORMERS_ROUTING = {"scoring_func": "softmax", "router_bias_update_rate": 0.0}


def reject_inexpressible(cfg, required: dict = TRANSFORMERS_ROUTING) -> None:
    """One-line error for a `config.model` option the transformers model cannot express (saving
    would silently change the routing, e.g. loss-free balancing's bias)."""
    for key, value in required.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"model.{key}={cfg[key]!r} has no transformers equivalent (only {value!r}); cannot save")


def rope_from_hf(hf: dict, default_theta: float) -> tuple[float, dict]:
    """(rope_theta, rope_scaling) from either layout: transformers 5's `rope_parameters`, or Llama
    3.x's top-level `rope_theta` + `rope_scaling` (which transformers prefers when both exist)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
    scaling = decoder_config().rope_scaling.to_dict()  # llama3 fields unused by "default"
    scaling["rope_type"] = rope_type
    if rope_type == "linear":
        scaling["factor"] = float(field(rope, "factor"))
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
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor, "rope_theta": cfg.rope_theta}, {"rope_type": "linear", "factor": s.factor}
    scaling = {key: s[key] for key in ("rope_type", "original_max_position_embeddings") + LLAMA3_FACTORS}
    return {**scaling, "rope_theta": cfg.rope_theta}, scaling


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def decoder_model_fields(hf: dict, *, default_eps: float, default_theta: float) -> dict:
    """The `config.model` fields every decoder family shares (`jaxpar.models.schema`), from a
    config.json dict; `default_*`: the family's transformers defaults for keys the file omits."""
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
class FromConfig:
    """A layer value transformers keeps in its config, not among the tensors (each layer's attention
    window: `jaxpar.models.attention_pattern.layer_windows`): `value(cfg, layer)` gives one layer's;
    nothing is written or read from the files."""

    value: Callable

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        return np.asarray(self.value(cfg, int(prefix.rstrip(".").rsplit(".", 1)[1])), np.float32)

    def write(self, w, prefix: str, cfg) -> dict:
        return {}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        return self.read(get, prefix, cfg)[index]

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        return [{}]


@dataclass(frozen=True)
class FirstOf:
    """One layer tensor stored under either of several names (written under the first)."""

    names: tuple[str, ...]
    layout: Layout = COPY

    def _name(self, get, prefix: str) -> str:
        return next((prefix + n for n in self.names if get.has(prefix + n)), prefix + self.names[0])

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        return self.layout.to_jax(get(self._name(get, prefix)), cfg)

    def write(self, w, prefix: str, cfg) -> dict:
        return {prefix + self.names[0]: self.layout.to_hf(w, cfg)}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        return self.layout.block(get, self._name(get, prefix), cfg, index, shape)

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        return [{prefix + n: self.layout.to_hf_shape(shape, cfg)} for n in self.names]


@dataclass(frozen=True)
class ExpertStack:
    """One projection ("gate" | "up" | "down") of all of a layer's experts <-> jaxpar's [E, in, out].

    On disk either per expert (`per_expert`, with `{}` for the expert index: [out, in] each), or
    fused as transformers 5 keeps them in memory: `fused_gate_up` [E, 2F, D] (gate rows first)
    and `fused_down` [E, D, F]."""

    part: str
    per_expert: str  # e.g. "mlp.experts.{}.gate_proj.weight"
    fused_gate_up: str = "mlp.experts.gate_up_proj"
    fused_down: str = "mlp.experts.down_proj"

    def _fused(self) -> str:
        return self.fused_down if self.part == "down" else self.fused_gate_up

    def read(self, get, prefix: str, cfg) -> np.ndarray:
        if get.has(prefix + self.per_expert.format(0)):
            names = [prefix + self.per_expert.format(e) for e in range(_num_experts(get, prefix, self.per_expert))]
            return np.stack([get(n).T for n in names])
        fused = get(prefix + self._fused())
        if self.part == "down":
            return fused.transpose(0, 2, 1)
        f = fused.shape[1] // 2
        half = fused[:, :f] if self.part == "gate" else fused[:, f:]
        return half.transpose(0, 2, 1)

    def write(self, w, prefix: str, cfg) -> dict:
        return {prefix + self.per_expert.format(e): w[e].T for e in range(w.shape[0])}

    def read_block(self, get, prefix: str, cfg, index: tuple, shape: tuple) -> np.ndarray:
        if not get.has(prefix + self.per_expert.format(0)):
            return self.read(get, prefix, cfg)[index]  # fused: one layer's tensor, then the block
        e0, e1 = span(index[0], shape[0])
        names = [prefix + self.per_expert.format(e) for e in range(e0, e1)]
        return np.stack([LINEAR.block(get, n, cfg, index[1:], shape[1:]) for n in names])

    def on_disk(self, prefix: str, cfg, shape: tuple) -> list[dict]:
        experts, d_in, d_out = shape
        per_expert = {prefix + self.per_expert.format(e): (d_out, d_in) for e in range(experts)}
        if self.part == "down":  # down [E, F, D]: fused [E, D, F]
            return [per_expert, {prefix + self.fused_down: (experts, d_out, d_in)}]
        return [per_expert, {prefix + self.fused_gate_up: (experts, 2 * d_out, d_in)}]


def _num_experts(get, prefix: str, template: str) -> int:
    count = 0
    while get.has(prefix + template.format(count)):
        count += 1
    return count


def expert_stacks(per_expert: str, names: dict, **fused) -> dict:
    """The three `ExpertStack` entries of a layer's experts under `("mlp", "experts", part)`:
    `names` maps gate / up / down to the per-expert projection name (Mixtral's w1 / w3 / w2)."""
    return {
        ("mlp", "experts", part): ExpertStack(part, per_expert.format("{}", names[part]), **fused)
        for part in ("gate", "up", "down")
    }


@dataclass(frozen=True)
class Stack:
    """One stacked layer tree of the params (`key`: "layers" or "dense_layers") and the HF layer
    indices it holds, in stack order."""

    key: str
    indices: tuple[int, ...]
    table: dict


@dataclass(frozen=True)
class Wrapper:
    """A transformers model that holds the family's model inside it (Gemma 3's multimodal
    Gemma3ForConditionalGeneration holds a Gemma3ForCausalLM): loading reads only that inner model.
    `config_key` names its config.json section (`defaults`: the inner model's defaults for keys
    that section omits, `overrides`: the values the wrapper computes with whatever it says);
    `renamed` maps a prefix of the wrapper's tensor names to the inner model's own (every layout
    transformers writes); tensors under `ignored` are the other parts (a vision tower), not loaded."""

    model_type: str
    hf_class: str
    config_key: str
    renamed: dict
    ignored: tuple
    defaults: dict = dataclass_field(default_factory=dict)
    overrides: dict = dataclass_field(default_factory=dict)


@dataclass(frozen=True)
class Adapter:
    """What a family needs to read and write transformers checkpoints."""

    hf_class: str  # e.g. "LlamaForCausalLM"
    to_model_config: Callable[[dict], ConfigDict]  # config.json dict -> config.model
    to_hf_config: Callable[[ConfigDict], dict]  # config.model -> config.json fields
    layer_table: dict  # jaxpar path under params["layers"] -> entry (see the module docstring)
    # cfg -> the layer stacks (default: every layer in "layers", read with `layer_table`).
    stacks: Callable[[ConfigDict], list[Stack]] | None = None
    # The router options the transformers model computes with (`reject_inexpressible`).
    routing: dict = dataclass_field(default_factory=lambda: dict(TRANSFORMERS_ROUTING))
    # cfg -> {HF name: HF name it copies}: tensors the format repeats (DeepSeek-V3's MTP layer holds
    # the embedding and LM head again); written beside their source, checked equal to it on load.
    copies: Callable[[ConfigDict], dict] | None = None
    # (config.model from config.json, the checkpoint's tensor names) -> config.model of the tensors
    # it holds (parts of the format a checkpoint may leave out, e.g. DeepSeek-V3's MTP layers).
    fit_to_tensors: Callable[[ConfigDict, set], ConfigDict] | None = None
    # The models that hold this one inside (`Wrapper`): read, never written.
    wrappers: tuple = ()

    def layer_stacks(self, cfg) -> list[Stack]:
        if self.stacks is not None:
            return self.stacks(cfg)
        return [Stack("layers", tuple(range(cfg.num_hidden_layers)), self.layer_table)]
