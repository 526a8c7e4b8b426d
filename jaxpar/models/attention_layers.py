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

from jaxpar.models.attention_pattern import Pattern, attend, layer_windows, static_pattern
from jaxpar.models.decoder import Decoder
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
        self.softcap, self.scale = fixed.softcap, fixed.scale
        # Shape [1], not a scalar: nnx.vmap names the stacked axis `layers` only on a leaf with names.
        self.window = LayerWindow(jnp.zeros((1,), jnp.float32), out_sharding=(None,))
        self.has_sinks = bool(cfg.attention_sinks)
        if self.has_sinks:
            self.sinks = nnx.Param(normal_init(rngs, (cfg.num_attention_heads,), cfg.initializer_range), out_sharding=("heads",))

    def pattern(self) -> Pattern:
        sinks = self.sinks[...] if self.has_sinks else None
        return Pattern(self.window[...][0].astype(jnp.int32), sinks, self.softcap, self.scale)

    def __call__(self, x, positions, inv_freq, opts: RunOptions, segment_ids=None):
        with jax.named_scope("attention"):
            q, k, v = self._rotated_qkv(x, positions, inv_freq, opts)
            pattern = self.pattern()
            if opts.plan.context is not None:
                out = model_attention(q, k, v, positions, rules=opts.rules, plan=opts.plan, segment_ids=segment_ids,
                                      window=pattern.window, sinks=pattern.sinks, softcap=pattern.softcap,
                                      scale=pattern.scale)
            else:
                out = attend(q, k, v, opts.plan.attention, segment_ids, pattern)
            return self._output(out, opts)

    def cached(self, x, positions, inv_freq, kv_cache, write_at, mask, opts: RunOptions):
        # The decode cache's mask does not know the window, the sinks or the cap yet (issue 37, item 6).
        raise NotImplementedError("decoding with an attention pattern (windows, sinks, soft-capping) is not supported yet")


class PatternedDecoder(Decoder):
    """The decoder with `PatternedAttention`, each layer's window set from the model's pattern."""

    make_attention = PatternedAttention

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        windows = layer_windows(cfg).astype(np.float32)
        dense = set(type(self).dense_layer_indices(cfg))
        main = [w for i, w in enumerate(windows) if i not in dense]
        self.layers.attention.window.value = jnp.asarray(main, jnp.float32)[:, None]
        if self.dense_layers is not None:
            self.dense_layers.attention.window.value = jnp.asarray([windows[i] for i in sorted(dense)], jnp.float32)[:, None]
