"""Transformer building blocks shared by Llama and Mixtral (Flax NNX).

Every parameter carries logical axis names (`out_sharding` metadata); every activation constraint goes
through `jaxpar.sharding.constrain` with `act_*` names. Weights are stored in "math" layout
([in, out], heads split out), converted to/from transformers' [out, in] layout in `interop.hf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.sharding import Rules, constrain

# Stored vocab rows/columns are padded to a multiple of this (zeros, masked in the loss). It is a
# constant, not a function of the mesh, so parameter shapes and initial values never depend on it.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def head_dim_of(cfg) -> int:
    return cfg.head_dim if cfg.head_dim is not None else cfg.hidden_size // cfg.num_attention_heads


@dataclass(frozen=True)
class RunOptions:
    """How to run a forward pass: sharding rules (None: no mesh), dtypes, kernels, remat."""

    rules: Rules | None = None
    compute_dtype: jnp.dtype = jnp.float32
    attention_impl: str = "xla"
    remat: str = "none"
    # Rules for a layer's parameters inside the layer scan (ZeRO-3 gathers them there).
    gathered_rules: Rules | None = None
    # `jaxpar.parallel.pipeline.PipelineOptions` when the mesh's pipeline axis is > 1, else None.
    pipeline: object = None


def _normal(rngs: nnx.Rngs, shape, std):
    return jax.random.normal(rngs.params(), shape, jnp.float32) * std


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


def rope_inverse_frequencies(cfg) -> jnp.ndarray:
    """Per-pair rotation frequencies, with transformers' `default` and `llama3` rope types."""
    dim = head_dim_of(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "default":
        return inv_freq
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between.
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= original / low) & (wavelen >= original / high)
    return jnp.where(is_medium, smoothed, out)


def apply_rope(x, positions, inv_freq):
    """Rotates [B, S, H, D] by position, pairing dim i with i + D/2 (transformers' rotate_half)."""
    angles = positions[:, :, None].astype(jnp.float32) * inv_freq[None, None, :]  # [B, S, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention; q/k/v column-parallel, o row-parallel over `tensor`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
        std = cfg.initializer_range
        self.num_heads, self.num_kv_heads = h, kv
        self.q = nnx.Param(_normal(rngs, (d, h, hd), std), out_sharding=("embed", "heads", "head_dim"))
        self.k = nnx.Param(_normal(rngs, (d, kv, hd), std), out_sharding=("embed", "kv_heads", "head_dim"))
        self.v = nnx.Param(_normal(rngs, (d, kv, hd), std), out_sharding=("embed", "kv_heads", "head_dim"))
        self.o = nnx.Param(_normal(rngs, (h, hd, d), std), out_sharding=("heads", "head_dim", "embed"))

    def __call__(self, x, positions, inv_freq, opts: RunOptions):
        rules = opts.rules
        q = jnp.einsum("bsd,dhk->bshk", x, self.q[...])
        k = jnp.einsum("bsd,dhk->bshk", x, self.k[...])
        v = jnp.einsum("bsd,dhk->bshk", x, self.v[...])
        q = constrain(rules, apply_rope(q, positions, inv_freq), ("batch", "seq", "act_heads", "head_dim"))
        k = apply_rope(k, positions, inv_freq)
        if rules is not None and not rules.table["act_kv_heads"] and rules.table["act_heads"]:
            # KV heads fewer than (or not divisible by) tensor: give every query head its own copy,
            # so attention stays sharded by query head (Megatron replicates KV heads the same way).
            groups = self.num_heads // self.num_kv_heads
            whole = ("batch", "seq", None, "head_dim")
            k, v = constrain(rules, k, whole), constrain(rules, v, whole)
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            kv_names = ("batch", "seq", "act_heads", "head_dim")
        else:
            kv_names = ("batch", "seq", "act_kv_heads", "head_dim")
        k, v = constrain(rules, k, kv_names), constrain(rules, v, kv_names)
        out = causal_attention(q, k, v, _attention_impl(opts, q.dtype))
        out = constrain(rules, out, ("batch", "seq", "act_heads", "head_dim"))
        return jnp.einsum("bshk,hkd->bsd", out, self.o[...])


def causal_attention(q, k, v, implementation: str):
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU has no fp16 dot with fp32 accumulation, which the XLA attention path asks for.
        out = jax.nn.dot_product_attention(*(t.astype(jnp.float32) for t in (q, k, v)), is_causal=True)
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _attention_impl(opts: RunOptions, dtype):
    if opts.attention_impl == "auto":
        on_gpu = jax.default_backend() == "gpu"
        return "cudnn" if on_gpu and dtype in (jnp.bfloat16, jnp.float16) else "xla"
    return opts.attention_impl


class MLP(nnx.Module):
    """SwiGLU: gate/up column-parallel, down row-parallel over `tensor`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, f, std = cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range
        self.gate = nnx.Param(_normal(rngs, (d, f), std), out_sharding=("embed", "mlp"))
        self.up = nnx.Param(_normal(rngs, (d, f), std), out_sharding=("embed", "mlp"))
        self.down = nnx.Param(_normal(rngs, (f, d), std), out_sharding=("mlp", "embed"))

    def __call__(self, x, opts: RunOptions):
        hidden = jax.nn.silu(x @ self.gate[...]) * (x @ self.up[...])
        hidden = constrain(opts.rules, hidden, ("batch", "seq", "act_mlp"))
        return hidden @ self.down[...]


class Embedding(nnx.Module):
    """Vocab-parallel token embedding; rows past `vocab_size` are zero padding."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v, d = cfg.vocab_size, cfg.hidden_size
        table = _normal(rngs, (v, d), cfg.initializer_range)
        table = jnp.pad(table, ((0, padded_vocab_size(v) - v), (0, 0)))
        self.weight = nnx.Param(table, out_sharding=("vocab", "embed"))

    def __call__(self, tokens, opts: RunOptions):
        return jnp.take(self.weight[...], tokens, axis=0)


class LMHead(nnx.Module):
    """Vocab-parallel output projection [embed, vocab]; padded columns are zero."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v, d = cfg.vocab_size, cfg.hidden_size
        w = _normal(rngs, (d, v), cfg.initializer_range)
        self.weight = nnx.Param(jnp.pad(w, ((0, 0), (0, padded_vocab_size(v) - v))), out_sharding=("embed", "vocab"))


def project_to_vocab(x, weight_dv, vocab_size: int, opts: RunOptions):
    """fp32 logits [B, S, padded V], sharded over vocab; padded columns pushed to -inf-like."""
    if x.dtype == jnp.float16:
        # fp16 has too little range for logits, and XLA:CPU has no fp16×fp16→fp32 dot: use fp32.
        x, weight_dv = x.astype(jnp.float32), weight_dv.astype(jnp.float32)
    logits = jnp.einsum("bsd,dv->bsv", x, weight_dv, preferred_element_type=jnp.float32)
    logits = constrain(opts.rules, logits, ("batch", "seq", "act_vocab"))
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    return jnp.where(column < vocab_size, logits, jnp.finfo(jnp.float32).min)
