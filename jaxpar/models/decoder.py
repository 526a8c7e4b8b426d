"""The decoder every family is: embedding, a scanned stack of decoder blocks, final norm, LM head.

A family's module is a `Decoder` subclass that names its hooks: `make_attention` (default: the
grouped-query `Attention`) and `make_mlp` (default: the SwiGLU `MLP`; Mixtral's is the sparse MoE
block). Each hook is built as hook(cfg, rngs=...) and called like the default: attention as
(x, positions, inv_freq, opts, segment_ids=None) -> out (segment ids [B, S] of packed documents,
0 for padding; None: one sequence per row), the MLP as (x, opts) -> (out, aux) with aux its
per-layer statistics ({} for a dense MLP).

The blocks are created once with `nnx.vmap` (one stacked parameter per weight, leading logical
axis `layers`) and run with `jax.lax.scan` over their plain state: split once, merge the layer's
slice inside the scan body. ZeRO-3 gathers each layer's parameters there, one layer at a time
(`jaxpar.parallel.zero.gather_layer`).
"""

from __future__ import annotations

import jax
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
        mlp_out, aux = self.mlp(self.post_attention_norm(x), opts)
        return constrain(opts.rules, x + mlp_out, RESIDUAL), aux


def stacked_blocks(cfg, rngs: nnx.Rngs, make_attention, make_mlp):
    """`num_hidden_layers` blocks with independent init, stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(layer_rngs):
        return DecoderBlock(cfg, rngs=layer_rngs, make_attention=make_attention, make_mlp=make_mlp)

    return build(rngs)


def scan_blocks(blocks: nnx.Module, x, opts: RunOptions, layer_fn):
    """Runs `layer_fn(block, x) -> (x, layer_aux)` over the stacked blocks with `lax.scan` (and
    remat, if asked); returns x and the per-layer aux outputs stacked on a leading axis."""
    graphdef, state = nnx.split(blocks)
    # Each leaf's logical names without the leading `layers`: the names of one layer's slice.
    layer_names = jax.tree.map(
        lambda spec: tuple(spec)[1:], nnx.get_partition_spec(state),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )

    def body(h, layer_state):
        layer_state = gather_layer(layer_state, layer_names, opts.rules, opts.plan.zero)
        return layer_fn(nnx.merge(graphdef, layer_state), h)

    policy = layer_remat_policy(REMAT_POLICIES[opts.plan.remat], opts.plan.zero)
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, state)


class Decoder(nnx.Module):
    # The family's hooks (see the module docstring).
    make_attention = Attention
    make_mlp = MLP

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        self.layers = stacked_blocks(cfg, rngs, type(self).make_attention, type(self).make_mlp)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg, rngs=rngs)

    # The three pieces below are what a pipeline stage runs (`jaxpar.parallel.pipeline`): the
    # first stage embeds, every stage runs the blocks it was merged with, the last one projects.
    def embed_tokens(self, tokens, opts: RunOptions):
        # The vocab-parallel lookup first yields whole sequences (a masked gather + an all-reduce);
        # constraining it straight to the sequence-parallel layout made the partitioner gather the
        # whole table instead, and all-reduce its full gradient (found by `jaxpar.analysis`).
        x = constrain(opts.rules, self.embed(tokens), ("batch", "seq", "act_embed"))
        return constrain(opts.rules, x, RESIDUAL)

    def run_layers(self, x, positions, opts: RunOptions, segment_ids=None):
        """(x, per-layer aux) after every block in `self.layers` (a stage holds only its own)."""
        inv_freq = rope_inverse_frequencies(self.cfg)
        return scan_blocks(self.layers, x, opts, lambda block, h: block(h, positions, inv_freq, opts, segment_ids))

    def logits_from_hidden(self, x, opts: RunOptions):
        """Final norm + LM head on the last block's output."""
        tied = self.lm_head is None
        return project_to_vocab(self.final_norm(x), self.head_weight(), self.cfg.vocab_size, opts, tied=tied)

    def head_weight(self):
        return self.embed.weight[...].T if self.lm_head is None else self.lm_head.weight[...]

    def __call__(self, tokens, opts: RunOptions, positions=None, segment_ids=None):
        """(logits, aux): fp32 logits [B, S, padded vocab], vocab-sharded, padded columns masked;
        aux holds per-layer statistics stacked over layers ({} for dense Llama). `positions`
        [B, S] default to 0 .. S-1; `segment_ids` [B, S]: packed documents (see `Attention`)."""
        if positions is None:
            positions = default_positions(tokens)
        x, aux = self.run_layers(self.embed_tokens(tokens, opts), positions, opts, segment_ids)
        return self.logits_from_hidden(x, opts), aux
