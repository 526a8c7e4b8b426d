"""Transformer building blocks the decoder families share (Flax NNX).

Every parameter carries logical axis names (`out_sharding` metadata); every activation constraint
goes through `jaxpar.sharding.constrain` with `act_*` names. Weights are stored in "math" layout
([in, out], heads split out), converted to/from transformers' [out, in] layout in `interop`.
Matmul outputs that remat policies may keep are tagged with `checkpoint_name` (`SAVED_DOTS`);
each block runs under a `jax.named_scope`, so profiles say which part costs what.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.kernels import attention as attention_kernel
from jaxpar.kernels.dense import project
from jaxpar.model_facts import head_dim_of, padded_vocab_size
from jaxpar.models.attention_pattern import fused_attention
from jaxpar.models.fp8_state import fp8_args, histories
from jaxpar.models.options import RunOptions
from jaxpar.parallel.collective_matmul import column_parallel, row_parallel
from jaxpar.parallel.context.sharded import model_attention
from jaxpar.parallel.tensor import repeat_kv
from jaxpar.sharding import constrain

# Logical names of the projections' weights and outputs, for collective matmul's shard_map specs.
QKV_NAMES, KV_NAMES = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
Q_OUT, KV_OUT = ("batch", "seq", "act_heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
MLP_IN, MLP_OUT = ("embed", "mlp"), ("batch", "seq", "act_mlp")

# Names of the projection outputs (matmuls without batch dims) that the `save_dots` remat policy keeps.
SAVED_DOTS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up", "mlp_down", "router_logits")


def normal_init(rngs: nnx.Rngs, shape, std):
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
    """Per-pair rotation frequencies, with transformers' `default`, `linear` and `llama3` rope types."""
    dim = head_dim_of(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":  # every position divided by `factor`
        return inv_freq / scaling.factor
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
    """Causal grouped-query attention; q/k/v column-parallel, o row-parallel over `tensor`.

    `segment_ids` [B, S] (int; None: one sequence per row): packed documents, each attending only
    to itself; 0 marks padding, whose outputs are 0 (`causal_attention`)."""

    lora_side = None  # LoRA adapters beside the matrices (`jaxpar.models.lora_dropout.Side`: adapter dropout)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
        std = cfg.initializer_range
        self.q = nnx.Param(normal_init(rngs, (d, h, hd), std), out_sharding=("embed", "heads", "head_dim"))
        self.k = nnx.Param(normal_init(rngs, (d, kv, hd), std), out_sharding=("embed", "kv_heads", "head_dim"))
        self.v = nnx.Param(normal_init(rngs, (d, kv, hd), std), out_sharding=("embed", "kv_heads", "head_dim"))
        self.o = nnx.Param(normal_init(rngs, (h, hd, d), std), out_sharding=("heads", "head_dim", "embed"))
        self.fp8_history = histories(cfg, 4)  # q, k, v, o under delayed FP8 scaling (else None)

    @staticmethod
    def cache_layout(cfg, kv_repeat: int):
        """The decode cache: k and v, each [.., K', Dh] per slot (K' = KV heads × `kv_repeat`, the
        copies `jaxpar.parallel.tensor.repeat_kv` makes), laid out like the k / v activations."""
        entry = ((cfg.num_key_value_heads * kv_repeat, head_dim_of(cfg)), ("act_kv_heads", "head_dim"))
        return (entry, entry)

    def project_qkv(self, x, opts: RunOptions):
        """q [B, S, H, hd], k and v [B, S, Hkv, hd] of the normed input: the family hook. A
        family's attention class extends it (biases, per-head norms) before RoPE."""
        if opts.plan.tensor.collective_matmul:  # one ring of the sequence for all three (parallel/collective_matmul.py)
            q, k, v = column_parallel(x, (self.q[...], self.k[...], self.v[...]), opts.rules, (QKV_NAMES, KV_NAMES, KV_NAMES),
                                      (Q_OUT, KV_OUT, KV_OUT))
            q, k, v = checkpoint_name(q, "q_proj"), checkpoint_name(k, "k_proj"), checkpoint_name(v, "v_proj")
        else:
            split = opts.plan.splits_sequence
            q = checkpoint_name(project(x, self.q[...], splits_sequence=split, **fp8_args(opts, "q_proj", self.fp8_history, 0)), "q_proj")
            k = checkpoint_name(project(x, self.k[...], splits_sequence=split, **fp8_args(opts, "k_proj", self.fp8_history, 1)), "k_proj")
            v = checkpoint_name(project(x, self.v[...], splits_sequence=split, **fp8_args(opts, "v_proj", self.fp8_history, 2)), "v_proj")
        if self.lora_side is not None:
            q, k, v = (self.lora_side.add(name, x, y) for name, y in zip("qkv", (q, k, v)))
        return q, k, v

    def _rotated_qkv(self, x, positions, inv_freq, opts: RunOptions):
        """q [B, S, H, Dh] and k, v [B, S, K', Dh] (K' = KV heads, repeated for tensor when fewer
        than its ranks), each in its head layout, q and k rotated."""
        rules = opts.rules
        # Each projection is constrained to its head layout at once: left free, under sequence
        # parallelism the partitioner gathered the weights, ran RoPE on sequence-split q/k and
        # then all-to-all'd them to split heads (found by comparing with jaxpar.analysis).
        q, k, v = self.project_qkv(x, opts)
        q = constrain(rules, q, ("batch", "seq", "act_heads", "head_dim"))
        k, v = repeat_kv(k, v, opts.plan.tensor, rules)
        kv_names = ("batch", "seq", "act_kv_heads", "head_dim")
        k, v = constrain(rules, k, kv_names), constrain(rules, v, kv_names)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def _output(self, out, opts: RunOptions):
        out = constrain(opts.rules, out, ("batch", "seq", "act_heads", "head_dim"))
        if opts.plan.tensor.collective_matmul:
            y = checkpoint_name(row_parallel(out, self.o[...], opts.rules, Q_OUT, ("heads", "head_dim", "embed"), 2), "o_proj")
        else:
            fp8 = fp8_args(opts, "o_proj", self.fp8_history, 3)
            y = checkpoint_name(project(out, self.o[...], contract=2, splits_sequence=opts.plan.splits_sequence, **fp8), "o_proj")
        return y if self.lora_side is None else self.lora_side.add("o", out, y, contract=2)

    def __call__(self, x, positions, inv_freq, opts: RunOptions, segment_ids=None):
        with jax.named_scope("attention"):
            q, k, v = self._rotated_qkv(x, positions, inv_freq, opts)
            if opts.plan.context is not None:  # sequence split over devices: ring / all-gather / all-to-all
                out = model_attention(q, k, v, positions, rules=opts.rules, plan=opts.plan, segment_ids=segment_ids)
            else:
                out = causal_attention(q, k, v, opts.plan.attention, segment_ids)
            return self._output(out, opts)

    def cached(self, x, positions, inv_freq, kv_cache, write_at, mask, opts: RunOptions):
        """The decode path (`jaxpar.sampling`): writes this call's rotated k/v for x [B, T, D] into
        `kv_cache` (k, v [B, S, K', Dh]) at slots write_at .. write_at + T - 1, then attends over the
        whole cache where `mask` [B, T, S] allows. Returns (out [B, T, D], the updated cache)."""
        with jax.named_scope("attention"):
            q, k, v = self._rotated_qkv(x, positions, inv_freq, opts)
            k_cache, v_cache = (
                jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), write_at, axis=1)
                for cache, new in zip(kv_cache, (k, v))
            )
            out = attention_kernel.masked_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
            return self._output(out, opts), (k_cache, v_cache)


def causal_attention(q, k, v, implementation: str, segment_ids=None):
    """Causal attention of q [B, T, H, D] over k, v [B, T, K, D] in text order; with `segment_ids`
    [B, T] only within each segment, and 0 (padding) rows give 0."""
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU has no fp16 dot with fp32 accumulation, which the XLA attention paths ask for.
        q32, k32, v32 = (t.astype(jnp.float32) for t in (q, k, v))
        return causal_attention(q32, k32, v32, implementation, segment_ids).astype(q.dtype)
    if implementation == "jaxpar_xla":
        return attention_kernel.causal_attention(q, k, v, segment_ids)
    return fused_attention(q, k, v, implementation, segment_ids)


class MLP(nnx.Module):
    """SwiGLU: gate/up column-parallel, down row-parallel over `tensor`. `activation`: the gate's
    (a family's MLP may name another: Gemma's GeGLU takes tanh GELU)."""

    activation = staticmethod(jax.nn.silu)
    lora_side = None  # LoRA adapters beside the matrices (`jaxpar.models.lora_dropout.Side`: adapter dropout)

    def __init__(self, cfg, *, rngs: nnx.Rngs, ffn: int | None = None):
        """`ffn`: the hidden size (default `cfg.intermediate_size`; a shared expert's is its own)."""
        d, std = cfg.hidden_size, cfg.initializer_range
        f = cfg.intermediate_size if ffn is None else ffn
        self.gate = nnx.Param(normal_init(rngs, (d, f), std), out_sharding=("embed", "mlp"))
        self.up = nnx.Param(normal_init(rngs, (d, f), std), out_sharding=("embed", "mlp"))
        self.down = nnx.Param(normal_init(rngs, (f, d), std), out_sharding=("mlp", "embed"))
        self.fp8_history = histories(cfg, 3)  # gate, up, down under delayed FP8 scaling (else None)

    def __call__(self, x, opts: RunOptions, real=None):
        """(out, aux): the same contract as the MoE block; a dense MLP reports nothing (`real` unused)."""
        split, history = opts.plan.splits_sequence, self.fp8_history
        if opts.plan.tensor.collective_matmul:
            with jax.named_scope("mlp"):
                gate, up = column_parallel(x, (self.gate[...], self.up[...]), opts.rules, (MLP_IN, MLP_IN), (MLP_OUT, MLP_OUT))
                gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
                gate, up = self._side("gate", x, gate), self._side("up", x, up)
                hidden = constrain(opts.rules, type(self).activation(gate) * up, MLP_OUT)
                down = row_parallel(hidden, self.down[...], opts.rules, MLP_OUT, ("mlp", "embed"))
                return self._side("down", hidden, checkpoint_name(down, "mlp_down")), {}
        with jax.named_scope("mlp"):
            gate = checkpoint_name(project(x, self.gate[...], splits_sequence=split, **fp8_args(opts, "mlp_gate", history, 0)), "mlp_gate")
            up = checkpoint_name(project(x, self.up[...], splits_sequence=split, **fp8_args(opts, "mlp_up", history, 1)), "mlp_up")
            gate, up = self._side("gate", x, gate), self._side("up", x, up)
            hidden = constrain(opts.rules, type(self).activation(gate) * up, ("batch", "seq", "act_mlp"))
            down = project(hidden, self.down[...], splits_sequence=split, **fp8_args(opts, "mlp_down", history, 2))
            return self._side("down", hidden, checkpoint_name(down, "mlp_down")), {}

    def _side(self, name, x, y):
        return y if self.lora_side is None else self.lora_side.add(name, x, y)


class Embedding(nnx.Module):
    """Vocab-parallel token embedding; rows past `vocab_size` are zero padding."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v, d = cfg.vocab_size, cfg.hidden_size
        table = normal_init(rngs, (v, d), cfg.initializer_range)
        table = jnp.pad(table, ((0, padded_vocab_size(v) - v), (0, 0)))
        self.weight = nnx.Param(table, out_sharding=("vocab", "embed"))

    def __call__(self, tokens):
        with jax.named_scope("embedding"):
            return jnp.take(self.weight[...], tokens, axis=0)


class LMHead(nnx.Module):
    """Vocab-parallel output projection [embed, vocab]; padded columns are zero."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v, d = cfg.vocab_size, cfg.hidden_size
        w = normal_init(rngs, (d, v), cfg.initializer_range)
        self.weight = nnx.Param(jnp.pad(w, ((0, 0), (0, padded_vocab_size(v) - v))), out_sharding=("embed", "vocab"))


def project_to_vocab(x, weight_dv, vocab_size: int, opts: RunOptions, tied: bool = False, softcap: float | None = None):
    """fp32 logits [B, S, padded V], sharded over vocab; padded columns pushed to -inf-like.
    `tied`: the weight is the embedding table transposed, whose gradient autodiff sums with the
    embedding's before the data-parallel reduction (one all-reduce instead of two). `softcap`:
    logits become cap · tanh(logits / cap) before the padding is masked (None: not capped)."""
    with jax.named_scope("lm_head"):
        if x.dtype == jnp.float16:
            # fp16 has too little range for logits, and XLA:CPU has no fp16×fp16→fp32 dot: use fp32.
            x, weight_dv = x.astype(jnp.float32), weight_dv.astype(jnp.float32)
        if x.dtype == jnp.float32 and not tied:
            logits = project(x, weight_dv, splits_sequence=opts.plan.splits_sequence)
        else:
            logits = jnp.einsum("bsd,dv->bsv", x, weight_dv, preferred_element_type=jnp.float32)
        logits = constrain(opts.rules, logits, ("batch", "seq", "act_vocab"))
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        if vocab_size == logits.shape[-1]:  # no padded columns: skip a pass over [B, S, V]
            return logits
        column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        return jnp.where(column < vocab_size, logits, jnp.finfo(jnp.float32).min)
