"""The decoder every family is: embedding, a scanned stack of decoder blocks, final norm, LM head.

A family's module is a `Decoder` subclass that names its hooks: `make_attention` (default: the
grouped-query `Attention`) and `make_mlp` (default: the SwiGLU `MLP`; Mixtral's is the sparse MoE
block). Each hook is built as hook(cfg, rngs=...) and called like the default: attention as
(x, positions, inv_freq, opts, segment_ids=None) -> out (segment ids [B, S] of packed documents,
0 for padding; None: one sequence per row), the MLP as (x, opts, real=None) -> (out, aux) with aux
its per-layer statistics ({} for a dense MLP) and `real` [B, S] the tokens that are not padding
(None: every one).

The blocks are created once with `nnx.vmap` (one stacked parameter per weight, leading logical
axis `layers`) and run with `jax.lax.scan` over their plain state: split once, merge the layer's
slice inside the scan body. ZeRO-3 gathers each layer's parameters there, one layer at a time
(`jaxpar.parallel.zero.gather_layer`).

Dense layers among MoE layers (Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`): a family
names them with `dense_layer_indices(cfg)`; their blocks (MLP hook `make_dense_mlp`) are a second
stack, `dense_layers`, and `run_layers` scans each run of consecutive layers of one kind over a
static slice of its stack. Two stacks, not one stack with both MLPs per layer (the unused one's
weights in every layer: Qwen3-MoE's dense MLP is as large as all its active experts) nor a
per-layer `cond` (both branches' weights stacked alike, the same waste). The pipeline engine
stages the `layers` stack only (`run_stage`): a family whose dense layers lead the model names
their stack's axis `dense_layers_axis` "depth" (never staged: DeepSeek-V3), and the first stage
runs them before its own layers; other dense layers among MoE layers are refused with
`mesh.pipeline` > 1 (`jaxpar.models.checks.dense_layer_checks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models.layers import (
    MLP,
    SAVED_DOTS,
    Attention,
    Embedding,
    LMHead,
    RMSNorm,
    project_to_vocab,
    rope_inverse_frequencies,
)
from jaxpar.models.options import RunOptions
from jaxpar.parallel.context.sequence import default_positions
from jaxpar.parallel.zero import gather_layer, layer_remat_policy
from jaxpar.sharding import RESIDUAL, constrain

# What each `parallel.remat` name (`jaxpar.parallel.plan.REMAT_NAMES`) saves of a layer's forward.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.save_only_these_names(*SAVED_DOTS),
    # save_dots' projection outputs, kept in host memory instead of the device's and brought back for
    # the backward: device memory as with full, compute as with save_dots, plus the host traffic.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED_DOTS), offload_src="device",
        offload_dst="pinned_host"),
}


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, make_attention=Attention, make_mlp=MLP):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = make_attention(cfg, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, rngs=rngs)

    def __call__(self, x, positions, inv_freq, opts: RunOptions, segment_ids=None):
        """(x, aux): aux is what the MLP reports per layer (router statistics for MoE, else {})."""
        x = x + self.attention(self.input_norm(x), positions, inv_freq, opts, segment_ids=segment_ids)
        x = constrain(opts.rules, x, RESIDUAL)
        # Packed documents: padding is no token of the router's statistics (`jaxpar.models.moe`).
        real = None if segment_ids is None else segment_ids != 0
        mlp_out, aux = self.mlp(self.post_attention_norm(x), opts, real=real)
        return constrain(opts.rules, x + mlp_out, RESIDUAL), aux

    def cached(self, x, positions, inv_freq, kv_cache, write_at, mask, opts: RunOptions):
        """The decode path: (x, this layer's updated KV cache); see `Attention.cached`."""
        out, kv_cache = self.attention.cached(self.input_norm(x), positions, inv_freq, kv_cache, write_at, mask, opts)
        x = constrain(opts.rules, x + out, RESIDUAL)
        mlp_out, _ = self.mlp(self.post_attention_norm(x), opts)
        return constrain(opts.rules, x + mlp_out, RESIDUAL), kv_cache


def scaled(embedded, scale: float | None):
    """The embedding times a constant, rounded to fp32 then to its dtype (as transformers' Gemma)."""
    if scale is None:
        return embedded
    return embedded * jnp.asarray(scale, jnp.float32).astype(embedded.dtype)


def stacked_blocks(cfg, rngs: nnx.Rngs, make_attention, make_mlp, count: int | None = None, axis: str = "layers",
                   make_block=DecoderBlock):
    """`count` (default `num_hidden_layers`) blocks with independent init, stacked on a leading
    logical `axis` (the name decides only placement: "layers" may be staged over `pipeline`)."""

    @nnx.split_rngs(splits=cfg.num_hidden_layers if count is None else count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def build(layer_rngs):
        return make_block(cfg, rngs=layer_rngs, make_attention=make_attention, make_mlp=make_mlp)

    return build(rngs)


def scan_blocks(blocks: nnx.Module, x, opts: RunOptions, layer_fn, xs=None, span: tuple[int, int] | None = None):
    """Runs `layer_fn(block, x) -> (x, layer_aux)` over the stacked blocks (those in `span`, a
    static [start, stop), when given) with `lax.scan` (and remat, if asked); returns x and the
    per-layer aux outputs stacked on a leading axis. With `xs` (arrays stacked over the blocks run,
    e.g. a KV cache) it is `layer_fn(block, x, that block's slice of xs)`."""
    graphdef, state = nnx.split(blocks)
    if span is not None:
        state = jax.tree.map(lambda a: a[span[0] : span[1]], state)
    # Each leaf's logical names without the leading `layers`: the names of one layer's slice.
    layer_names = jax.tree.map(
        lambda spec: tuple(spec)[1:], nnx.get_partition_spec(state),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )

    def body(h, layer_state):
        layer_state = gather_layer(layer_state, layer_names, opts.rules, opts.plan.zero)
        return layer_fn(nnx.merge(graphdef, layer_state), h)

    def body_with_xs(h, layer_state_and_xs):
        layer_state, layer_xs = layer_state_and_xs
        layer_state = gather_layer(layer_state, layer_names, opts.rules, opts.plan.zero)
        return layer_fn(nnx.merge(graphdef, layer_state), h, layer_xs)

    if xs is not None:
        return jax.lax.scan(body_with_xs, x, (state, xs))
    policy = layer_remat_policy(REMAT_POLICIES[opts.plan.remat], opts.plan.zero)
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, state)


def layer_runs(num_layers: int, dense: tuple[int, ...]) -> list[tuple[bool, int, int]]:
    """Runs of consecutive layers of one kind, in order: (dense, start, stop) with start / stop
    indices into that kind's stack."""
    runs, counts = [], [0, 0]  # layers seen so far per kind: [main, dense]
    for i in range(num_layers):
        kind = i in dense
        if runs and runs[-1][0] == kind:
            runs[-1][2] += 1
        else:
            runs.append([kind, counts[kind], counts[kind] + 1])
        counts[kind] += 1
    return [tuple(r) for r in runs]


class Decoder(nnx.Module):
    # The family's hooks (see the module docstring).
    make_attention = Attention
    make_mlp = MLP
    make_dense_mlp = MLP  # the MLP of the layers `dense_layer_indices` names
    make_block = DecoderBlock  # the block around them (Gemma's has four norms)
    dense_layers_axis = "layers"  # their stack's leading logical axis ("depth": never staged, see the docstring)
    # cfg -> the RoPE inverse frequencies every block's attention receives.
    rope_frequencies = staticmethod(rope_inverse_frequencies)

    @staticmethod
    def dense_layer_indices(cfg) -> tuple[int, ...]:
        """Layers that use `make_dense_mlp` instead of `make_mlp` (none by default)."""
        del cfg
        return ()

    @staticmethod
    def prediction_depth(cfg) -> int:
        """Tokens ahead the model's multi-token prediction modules predict (0: none; see `__call__`)."""
        del cfg
        return 0

    @classmethod
    def cache_layout(cls, cfg, kv_repeat: int):
        """The decode cache (`extend`): per array, its shape and logical names after [layers, batch,
        slots] — the attention hook's (`Attention.cache_layout`)."""
        return cls.make_attention.cache_layout(cfg, kv_repeat)

    @classmethod
    def cache_shapes(cls, cfg, kv_repeat: int, rows: int, slots: int) -> tuple:
        """The decode cache's arrays: per array (its shape, its logical names), by default
        `cache_layout`'s after [layers, rows, slots] (`extend` receives them in this order)."""
        lead, names = (cfg.num_hidden_layers, rows, slots), ("layers", "batch", "seq")
        return tuple((lead + tuple(shape), names + tuple(more)) for shape, more in cls.cache_layout(cfg, kv_repeat))

    @staticmethod
    def embedding_scale(cfg) -> float | None:
        """A constant the embedded tokens are multiplied by (None: none; Gemma's √hidden)."""
        del cfg
        return None

    @staticmethod
    def final_logit_softcap(cfg) -> float | None:
        """logits become cap · tanh(logits / cap) (None: not capped; Gemma 2's)."""
        del cfg
        return None

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        kind = type(self)
        dense = kind.dense_layer_indices(cfg)
        main = cfg.num_hidden_layers - len(dense)
        self.layers = stacked_blocks(cfg, rngs, kind.make_attention, kind.make_mlp, count=main, make_block=kind.make_block)
        self.dense_layers = (
            stacked_blocks(cfg, rngs, kind.make_attention, kind.make_dense_mlp, count=len(dense), axis=kind.dense_layers_axis,
                           make_block=kind.make_block)
            if dense else None
        )
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg, rngs=rngs)

    # The three pieces below are what a pipeline stage runs (`jaxpar.parallel.pipeline`): the
    # first stage embeds, every stage runs the blocks it was merged with, the last one projects.
    def embed_tokens(self, tokens, opts: RunOptions):
        # The vocab-parallel lookup first yields whole sequences (a masked gather + an all-reduce);
        # constraining it straight to the sequence-parallel layout made the partitioner gather the
        # whole table instead, and all-reduce its full gradient (found by `jaxpar.analysis`).
        x = constrain(opts.rules, scaled(self.embed(tokens), type(self).embedding_scale(self.cfg)), ("batch", "seq", "act_embed"))
        return constrain(opts.rules, x, RESIDUAL)

    def run_layers(self, x, positions, opts: RunOptions, segment_ids=None):
        """(x, per-layer aux) after every block in `self.layers` (a stage holds only its own), and
        `self.dense_layers` in their places; aux is stacked over the `layers` stack's blocks."""
        inv_freq = type(self).rope_frequencies(self.cfg)
        run = lambda block, h: block(h, positions, inv_freq, opts, segment_ids)  # noqa: E731
        if self.dense_layers is None:
            return scan_blocks(self.layers, x, opts, run)
        dense = type(self).dense_layer_indices(self.cfg)
        main_aux = []
        for is_dense, start, stop in layer_runs(self.cfg.num_hidden_layers, dense):
            x, aux = scan_blocks(self.dense_layers if is_dense else self.layers, x, opts, run, span=(start, stop))
            if not is_dense:
                main_aux.append(aux)
        return x, jax.tree.map(lambda *parts: jnp.concatenate(parts), *main_aux)

    def run_stage(self, x, positions, opts: RunOptions, segment_ids=None, *, first: bool = False):
        """A pipeline stage's blocks (`jaxpar.parallel.pipeline.stage`): (x, per-layer aux) after
        the stage's share of `self.layers`, preceded on the first stage by every `dense_layers`
        block (a family stages dense layers only where they lead the model)."""
        inv_freq = type(self).rope_frequencies(self.cfg)
        run = lambda block, h: block(h, positions, inv_freq, opts, segment_ids)  # noqa: E731
        if first and self.dense_layers is not None:
            x, _ = scan_blocks(self.dense_layers, x, opts, run)
        return scan_blocks(self.layers, x, opts, run)

    def logits_from_hidden(self, x, opts: RunOptions):
        """Final norm + LM head on the last block's output."""
        tied, cap = self.lm_head is None, type(self).final_logit_softcap(self.cfg)
        return project_to_vocab(self.final_norm(x), self.head_weight(), self.cfg.vocab_size, opts, tied=tied, softcap=cap)

    def head_weight(self):
        return self.embed.weight[...].T if self.lm_head is None else self.lm_head.weight[...]

    def __call__(self, tokens, opts: RunOptions, positions=None, segment_ids=None, ahead=None):
        """(logits, aux): fp32 logits [B, S, padded vocab], vocab-sharded, padded columns masked;
        aux holds per-layer statistics stacked over layers ({} for dense Llama). `positions`
        [B, S] default to 0 .. S-1; `segment_ids` [B, S]: packed documents (see `Attention`).
        `ahead` [D, B, S] (D = `prediction_depth`): token i + k of each position i at depth k
        (1 .. D); given, the multi-token prediction modules run too (`predict_ahead`)."""
        if positions is None:
            positions = default_positions(tokens)
        x, aux = self.run_layers(self.embed_tokens(tokens, opts), positions, opts, segment_ids)
        logits = self.logits_from_hidden(x, opts)
        if ahead is None:
            return logits, aux
        return logits, self.predict_ahead(x, ahead, positions, opts, segment_ids, aux)

    def predict_ahead(self, x, ahead, positions, opts: RunOptions, segment_ids, aux):
        """`aux` with the multi-token predictions from the last block's output x: "ahead_logits"
        [D, B, S, padded vocab] (depth k's prediction of token i + k + 1) and the modules' own
        per-layer statistics appended. A family with such modules defines it."""
        raise ValueError(f"model.model_type={self.cfg.model_type!r} has no multi-token prediction modules")

    def extend(self, tokens, positions, cache, write_at, mask, opts: RunOptions):
        """The decode path (`jaxpar.sampling`): runs tokens [B, T] at `positions` [B, T], writing
        their keys / values into `cache` (a tuple of arrays [layers, B, S, ...] laid out as
        `cache_layout`; k, v [layers, B, S, K', Dh] by default) at slots write_at .. +T-1
        and attending over the cache where `mask` [B, T, S] allows (no remat: nothing is
        differentiated). Returns (fp32 logits of the last position [B, 1, padded vocab], cache)."""
        inv_freq = type(self).rope_frequencies(self.cfg)

        def layer(block, h, kv_cache):
            return block.cached(h, positions, inv_freq, kv_cache, write_at, mask, opts)

        x = self.embed_tokens(tokens, opts)
        if self.dense_layers is None:
            x, cache = scan_blocks(self.layers, x, opts, layer, xs=cache)
            return self.logits_from_hidden(x[:, -1:], opts), cache
        # Dense layers among the main ones: the cache is in model layer order, each run of one
        # kind takes its consecutive slice of it.
        parts, first = [], 0
        for is_dense, start, stop in layer_runs(self.cfg.num_hidden_layers, type(self).dense_layer_indices(self.cfg)):
            run_cache = jax.tree.map(lambda a: a[first : first + stop - start], cache)  # noqa: B023 (called here)
            blocks = self.dense_layers if is_dense else self.layers
            x, run_cache = scan_blocks(blocks, x, opts, layer, xs=run_cache, span=(start, stop))
            parts.append(run_cache)
            first += stop - start
        cache = jax.tree.map(lambda *p: jnp.concatenate(p), *parts)
        return self.logits_from_hidden(x[:, -1:], opts), cache
