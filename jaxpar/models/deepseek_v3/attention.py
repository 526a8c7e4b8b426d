"""Multi-head latent attention (MLA, DeepSeek-V2/V3; transformers' DeepseekV3Attention).

Queries: x → `q_a` [D, q_lora_rank] → RMSNorm → `q_b` [q_lora_rank, H, nope + rope] (or one
`q` [D, H, nope + rope] when `q_lora_rank` is None). Keys and values: x → `kv_a` [D, kv_lora_rank +
rope] gives each token's latent (RMSNorm'd) and one RoPE key shared by all heads; `kv_b`
[kv_lora_rank, H, nope + v] expands the latent into each head's key (its nope part, the shared
RoPE key appended) and value. Only the `rope` dims rotate (`rope.rotate`). Output: `o` [H, v, D].

Tensor parallelism splits the heads (`q`/`q_b`, `kv_b`, `o`); the down-projections and the latent
norms are small and replicated, and the latents are gathered along the sequence before the
up-projections (under sequence parallelism that gathers kv_lora_rank + rope numbers per token, not D).

The attention kernels (plain, packed documents, every context-parallel implementation) take one
head size for q, k and v: the smaller of (nope + rope) and v is padded with zeros to the larger,
and q carries the softmax scale (`rope.softmax_scale`) times sqrt(that size), which the kernels'
own 1 / sqrt(size) cancels. Zero value columns give zero outputs, which are cut off again.

FP8 (`train.fp8`): every projection runs in FP8 (`jaxpar.kernels.fp8.fp8_project`) under the
names of `jaxpar.fp8.FP8_MATMULS` that its activations are saved by: the query path (`q`, or `q_a`
and `q_b`) is `q_proj`, the latent down-projection `kv_a` is `k_proj`, the up-projection `kv_b`
(each head's key and value) is `v_proj`, `o` is `o_proj`. Delayed scaling keeps one history per
matrix (`fp8_matrices`). The latent norms and the attention itself stay in the compute dtype, as
in DeepSeek-V3's own FP8 training. With `kv_b` in FP8, context parallelism gathers the expanded K
and V, not the latents (`jaxpar.parallel.context.plan`): in the latent gather each context rank's
K / V cotangent is only its own queries' part, and rounding parts to e5m2 is not rounding their
sum (measured in docs/fp8.md).

Decoding (`cached`) keeps only each token's latent and RoPE key (kv_lora_rank + rope numbers per
layer) and absorbs `kv_b` into the query and the output: q_nope · k_nope = (q_nope · W_k) · latent
per head, so the cache is attended to as one shared key [latent, rope key] and the context read
back in the latent space is expanded by W_v afterwards.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.kernels import attention as attention_kernel
from jaxpar.kernels.dense import project
from jaxpar.models.deepseek_v3 import rope
from jaxpar.models.fp8_state import fp8_args, histories
from jaxpar.models.layers import RMSNorm, causal_attention, normal_init
from jaxpar.models.options import RunOptions
from jaxpar.parallel.context.latent import latent_attention
from jaxpar.parallel.context.sharded import model_attention
from jaxpar.sharding import constrain

# transformers' q_a_layernorm and kv_a_layernorm keep DeepseekV3RMSNorm's default epsilon, whatever rms_norm_eps is.
LATENT_NORM_EPS = 1e-6
HEADS = ("batch", "seq", "act_heads", "head_dim")
WHOLE_SEQUENCE = ("batch", "seq", None)
# Each matrix's FP8 matmul name (module docstring); its position in `fp8_matrices` is its history's index.
FP8_NAMES = {"q": "q_proj", "q_a": "q_proj", "q_b": "q_proj", "kv_a": "k_proj", "kv_b": "v_proj", "o": "o_proj"}


def fp8_matrices(cfg) -> tuple:
    """The matrices of one MLA, in the order of its delayed-scaling histories."""
    query = ("q",) if cfg.q_lora_rank is None else ("q_a", "q_b")
    return query + ("kv_a", "kv_b", "o")


def _pad_last(x, size: int):
    extra = size - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


class LatentAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, h, std = cfg.hidden_size, cfg.num_attention_heads, cfg.initializer_range
        self.cfg = cfg
        self.nope, self.rope, self.v_dim, self.rank = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
        )
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q = nnx.Param(normal_init(rngs, (d, h, qk), std), out_sharding=("embed", "heads", "head_dim"))
        else:
            self.q_a = nnx.Param(normal_init(rngs, (d, cfg.q_lora_rank), std), out_sharding=("embed", "latent"))
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = nnx.Param(
                normal_init(rngs, (cfg.q_lora_rank, h, qk), std), out_sharding=("latent", "heads", "head_dim")
            )
        self.kv_a = nnx.Param(normal_init(rngs, (d, self.rank + self.rope), std), out_sharding=("embed", "latent"))
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b = nnx.Param(
            normal_init(rngs, (self.rank, h, self.nope + self.v_dim), std), out_sharding=("latent", "heads", "head_dim")
        )
        self.o = nnx.Param(normal_init(rngs, (h, self.v_dim, d), std), out_sharding=("heads", "head_dim", "embed"))
        self.fp8_history = histories(cfg, len(fp8_matrices(cfg)))  # under delayed FP8 scaling (else None)

    def _fp8(self, opts: RunOptions, matrix: str) -> dict:
        """`project`'s FP8 keywords for `matrix` (none without FP8)."""
        return fp8_args(opts, FP8_NAMES[matrix], self.fp8_history, fp8_matrices(self.cfg).index(matrix))

    @staticmethod
    def cache_layout(cfg, kv_repeat: int):
        """The decode cache: per slot one latent and RoPE key [1, kv_lora_rank + rope], shared by
        every head (so never split over tensor)."""
        del kv_repeat
        return (((1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), (None, None)),)

    def queries(self, x, positions, inv_freq, opts: RunOptions):
        """q [B, S, H, nope + rope], its RoPE part rotated, split over heads."""
        split, rules = opts.plan.splits_sequence, opts.rules
        if self.cfg.q_lora_rank is None:
            q = project(x, self.q[...], splits_sequence=split, **self._fp8(opts, "q"))
        else:
            latent = self.q_a_norm(project(x, self.q_a[...], splits_sequence=split, **self._fp8(opts, "q_a")))
            q = project(constrain(rules, latent, WHOLE_SEQUENCE), self.q_b[...], splits_sequence=split, **self._fp8(opts, "q_b"))
        q = constrain(rules, checkpoint_name(q, "q_proj"), HEADS)
        return jnp.concatenate([q[..., : self.nope], rope.rotate(q[..., self.nope :], positions, inv_freq, self.cfg)], -1)

    def latent(self, x, positions, inv_freq, opts: RunOptions):
        """What a token leaves for later ones: its normed latent [B, S, kv_lora_rank] and its
        rotated RoPE key [B, S, 1, rope]."""
        kv_a = project(x, self.kv_a[...], splits_sequence=opts.plan.splits_sequence, **self._fp8(opts, "kv_a"))
        kv = checkpoint_name(kv_a, "k_proj")
        latent = self.kv_a_norm(kv[..., : self.rank])
        return latent, rope.rotate(kv[..., None, self.rank :], positions, inv_freq, self.cfg)

    def expand(self, latent, rope_key, opts: RunOptions):
        """Each head's k [B, S, H, nope + rope] and v [B, S, H, v] from the latents."""
        rules = opts.rules
        latent = constrain(rules, latent, WHOLE_SEQUENCE)
        rope_key = constrain(rules, rope_key, WHOLE_SEQUENCE + (None,))
        kv = project(latent, self.kv_b[...], splits_sequence=opts.plan.splits_sequence, **self._fp8(opts, "kv_b"))
        kv = constrain(rules, checkpoint_name(kv, "v_proj"), HEADS)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_key, k_nope.shape[:-1] + (self.rope,))], axis=-1)
        return constrain(rules, k, HEADS), v

    def output(self, heads, opts: RunOptions):
        """[B, S, H, v] → [B, S, D] through `o` (row-parallel over tensor)."""
        heads = constrain(opts.rules, heads, HEADS)
        out = project(heads, self.o[...], contract=2, splits_sequence=opts.plan.splits_sequence, **self._fp8(opts, "o"))
        return checkpoint_name(out, "o_proj")

    def padded(self, k, v):
        """k and v padded to the kernels' one head size (module docstring)."""
        size = max(self.nope + self.rope, self.v_dim)
        return _pad_last(k, size), _pad_last(v, size)

    def expand_gathered(self, latents, kv_b):
        """(k, v) at the kernels' head size from whole-sequence latents (latent, RoPE key) and `kv_b`:
        the up-projection `jaxpar.parallel.context.latent` runs on every context rank."""
        latent, rope_key = latents
        kv = jnp.einsum("bsr,rhe->bshe", latent, kv_b)
        k_nope = kv[..., : self.nope]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_key, k_nope.shape[:-1] + (self.rope,))], axis=-1)
        return self.padded(k, kv[..., self.nope :])

    def __call__(self, x, positions, inv_freq, opts: RunOptions, segment_ids=None):
        with jax.named_scope("attention"):
            q = self.queries(x, positions, inv_freq, opts)
            size = max(self.nope + self.rope, self.v_dim)
            q = _pad_last(q * jnp.asarray(rope.softmax_scale(self.cfg) * math.sqrt(size), q.dtype), size)
            context = opts.plan.context
            if context is not None and context.latent:  # gather the latents, expand on every rank
                latents = self.latent(x, positions, inv_freq, opts)
                names = (("batch", "seq", None), ("batch", "seq", None, None))
                out = latent_attention(
                    q, latents, names, self.kv_b[...], ("latent", "heads", "head_dim"), self.expand_gathered, positions,
                    rules=opts.rules, plan=opts.plan, segment_ids=segment_ids,
                )
            else:
                k, v = self.padded(*self.expand(*self.latent(x, positions, inv_freq, opts), opts))
                if context is not None:  # sequence split over devices: ring / all-gather / all-to-all
                    out = model_attention(q, k, v, positions, rules=opts.rules, plan=opts.plan, segment_ids=segment_ids)
                else:
                    out = causal_attention(q, k, v, opts.plan.attention, segment_ids)
            return self.output(out[..., : self.v_dim], opts)

    def cached(self, x, positions, inv_freq, kv_cache, write_at, mask, opts: RunOptions):
        """The decode path (`jaxpar.sampling`): writes this call's latents and RoPE keys for x [B, T, D]
        into the cache ([B, S, 1, kv_lora_rank + rope]) at slots write_at .. write_at + T - 1, then
        attends with `kv_b` absorbed (module docstring) where `mask` [B, T, S] allows."""
        with jax.named_scope("attention"):
            q = self.queries(x, positions, inv_freq, opts)
            latent, rope_key = self.latent(x, positions, inv_freq, opts)
            (cache,) = kv_cache
            entry = jnp.concatenate([latent[:, :, None, :], rope_key], axis=-1).astype(cache.dtype)
            cache = jax.lax.dynamic_update_slice_in_dim(cache, entry, write_at, axis=1)
            w = self.kv_b[...]
            q_latent = jnp.einsum("bthn,rhn->bthr", q[..., : self.nope], w[..., : self.nope])
            size = self.rank + self.rope
            scale = jnp.asarray(rope.softmax_scale(self.cfg) * math.sqrt(size), q.dtype)
            q = jnp.concatenate([q_latent, q[..., self.nope :]], axis=-1) * scale
            keys = cache.astype(q.dtype)
            context = attention_kernel.masked_attention(q, keys, keys, mask)[..., : self.rank]  # values: the latents
            heads = jnp.einsum("bthr,rhv->bthv", context, w[..., self.nope :])
            return self.output(heads, opts), (cache,)
