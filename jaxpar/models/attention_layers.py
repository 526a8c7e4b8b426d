"""The attention pattern in the model: `PatternedAttention` and the `PatternedDecoder` a family opts into.

Each layer's window is a leaf of the layer stack, `LayerWindow` (a scalar per layer, stacked on
`layers` like every weight), not Python branching per layer: the layer scan hands each step its
window as data, and the pipeline engine stages it with the layer's weights (any cut of the pattern,
uneven stages included), ZeRO-3 gathers it, checkpoints keep it. It is model state
(`jaxpar.models.state.ObservedState`) whose rule keeps its value, so the optimizer never moves it
(its gradient is zero: the forward only compares with it). Stored as fp32; the pipeline casts layer
leaves to the compute dtype, so `ranges` refuses windows 16-bit floats do not hold exactly.

`PatternedDecoder` sets each layer's window from `layer_windows(cfg)` after building the stacks;
`PatternedAttention` adds the `sinks` parameter (logical axis `heads`: sharded over `tensor` with
the query heads) when `model.attention_sinks`, and calls the pattern-aware path of each
implementation (`jaxpar.models.attention_pattern.attend`, `jaxpar.parallel.context.sharded`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models.attention_cache import layer_runs, ring_attention
from jaxpar.models.attention_pattern import Pattern, attend, layer_windows, static_pattern
from jaxpar.models.decoder import Decoder, scan_blocks
from jaxpar.models.layers import Attention, normal_init
from jaxpar.models.options import RunOptions
from jaxpar.models.state import ObservedState
from jaxpar.parallel.context.sharded import model_attention


class LayerWindow(ObservedState):
    """A layer's window (0: full), a per-layer constant: its update keeps the previous value."""

    @staticmethod
    def update(previous, observation, **metadata):
        del observation, metadata
        return previous


class PatternedAttention(Attention):
    """Grouped-query attention with the layer's window, the model's sinks, soft-cap and scale."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        fixed = static_pattern(cfg)
        self.softcap, self.scale, self.span = fixed.softcap, fixed.scale, fixed.span
        # Shape [1], not a scalar: nnx.vmap names the stacked axis `layers` only on a leaf with names.
        self.window = LayerWindow(jnp.zeros((1,), jnp.float32), out_sharding=(None,))
        self.has_sinks = bool(cfg.attention_sinks)
        if self.has_sinks:
            self.sinks = nnx.Param(normal_init(rngs, (cfg.num_attention_heads,), cfg.initializer_range), out_sharding=("heads",))

    def pattern(self) -> Pattern:
        sinks = self.sinks[...] if self.has_sinks else None
        return Pattern(self.window[...][0].astype(jnp.int32), sinks, self.softcap, self.scale, self.span)

    def layer_frequencies(self, inv_freq):
        """This layer's RoPE frequencies: `inv_freq` itself, or, given one row per layer kind
        ([2, Dh/2]: full, sliding; Gemma 3's two bases), the row of this layer's kind, picked by
        its window (data, so layers of both kinds share a scan and any pipeline stage)."""
        if inv_freq.ndim == 1:
            return inv_freq
        return jnp.where(self.window[...][0] > 0, inv_freq[1], inv_freq[0])

    def __call__(self, x, positions, inv_freq, opts: RunOptions, segment_ids=None):
        with jax.named_scope("attention"):
            q, k, v = self._rotated_qkv(x, positions, self.layer_frequencies(inv_freq), opts)
            pattern = self.pattern()
            if opts.plan.context is not None:
                out = model_attention(q, k, v, positions, rules=opts.rules, plan=opts.plan, segment_ids=segment_ids,
                                      window=pattern.window, sinks=pattern.sinks, softcap=pattern.softcap,
                                      scale=pattern.scale, span=pattern.span)
            else:
                out = attend(q, k, v, opts.plan.attention, segment_ids, pattern)
            return self._output(out, opts)

    def cached(self, x, positions, inv_freq, kv_cache, write_at, mask, opts: RunOptions):
        """The decode path: `kv_cache` is this layer's ring (`jaxpar.models.attention_cache`: the
        whole cache for a full layer, its window for a sliding one); see `Attention.cached`."""
        with jax.named_scope("attention"):
            q, k, v = self._rotated_qkv(x, positions, self.layer_frequencies(inv_freq), opts)
            out, kv_cache = ring_attention(q, k, v, kv_cache, write_at, mask, self.pattern())
            return self._output(out, opts), kv_cache


class PatternedDecoder(Decoder):
    """The decoder with `PatternedAttention`, each layer's window set from the model's pattern.
    Decoding keeps two cache stacks when some layers slide: the full layers' [full layers, rows,
    slots, ...] arrays, then the sliding layers' [sliding layers, rows, min(window, slots), ...]
    (`jaxpar.models.attention_cache`)."""

    make_attention = PatternedAttention

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        windows = layer_windows(cfg).astype(np.float32)
        dense = set(type(self).dense_layer_indices(cfg))
        main = [w for i, w in enumerate(windows) if i not in dense]
        self.layers.attention.window.value = jnp.asarray(main, jnp.float32)[:, None]
        if self.dense_layers is not None:
            self.dense_layers.attention.window.value = jnp.asarray([windows[i] for i in sorted(dense)], jnp.float32)[:, None]

    @classmethod
    def cache_shapes(cls, cfg, kv_repeat: int, rows: int, slots: int) -> tuple:
        windows = layer_windows(cfg)
        sliding = int(np.sum(windows > 0))
        if not sliding:
            return super().cache_shapes(cfg, kv_repeat, rows, slots)
        ring = min(int(windows.max()), slots)
        names = ("layers", "batch", "seq")
        return tuple(
            ((count, rows, size) + tuple(shape), names + tuple(more))
            for count, size in ((len(windows) - sliding, slots), (sliding, ring))
            for shape, more in cls.cache_layout(cfg, kv_repeat)
        )

    def extend(self, tokens, positions, cache, write_at, mask, opts: RunOptions):
        """`Decoder.extend` over the two cache stacks (`cache_shapes`): each run of consecutive
        layers of one kind is scanned over its slice of its kind's stack."""
        windows = layer_windows(self.cfg)
        if not np.any(windows > 0):
            return super().extend(tokens, positions, cache, write_at, mask, opts)
        if self.dense_layers is not None:
            raise ValueError(f"model.model_type={self.cfg.model_type!r}: decoding dense layers among sliding ones is not supported")
        inv_freq = type(self).rope_frequencies(self.cfg)

        def layer(block, h, kv_cache):
            return block.cached(h, positions, inv_freq, kv_cache, write_at, mask, opts)

        half = len(cache) // 2
        stacks, parts = (cache[:half], cache[half:]), ([], [])
        x = self.embed_tokens(tokens, opts)
        for sliding, start, stop, first in layer_runs(windows):
            run_cache = tuple(a[first : first + stop - start] for a in stacks[sliding])
            x, run_cache = scan_blocks(self.layers, x, opts, layer, xs=run_cache, span=(start, stop))
            parts[sliding].append(run_cache)
        joined = [stack if not part else tuple(jnp.concatenate(p) for p in zip(*part)) for stack, part in zip(stacks, parts)]
        return self.logits_from_hidden(x[:, -1:], opts), joined[0] + joined[1]
