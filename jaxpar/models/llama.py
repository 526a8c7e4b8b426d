"""Llama as a Flax NNX module: embedding, a scanned stack of decoder blocks, final norm, LM head.

The blocks are created once with `nnx.vmap` (one stacked parameter per weight, leading logical
axis `layers`) and run with `jax.lax.scan` over their plain state: split once, merge the layer's
slice inside the scan body. ZeRO-3 gathers each layer's parameters there, one layer at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models.layers import (
    MLP,
    Attention,
    Embedding,
    LMHead,
    RMSNorm,
    RunOptions,
    project_to_vocab,
    rope_inverse_frequencies,
)
from jaxpar.sharding import constrain

RESIDUAL = ("batch", "act_seq", "act_embed")

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, make_mlp=MLP):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, rngs=rngs)

    def __call__(self, x, positions, inv_freq, opts: RunOptions):
        """(x, aux): aux is what the MLP reports per layer (router statistics for MoE, else {})."""
        x = x + self.attention(self.input_norm(x), positions, inv_freq, opts)
        x = constrain(opts.rules, x, RESIDUAL)
        mlp_out = self.mlp(self.post_attention_norm(x), opts)
        mlp_out, aux = mlp_out if isinstance(mlp_out, tuple) else (mlp_out, {})
        return constrain(opts.rules, x + mlp_out, RESIDUAL), aux


def stacked_blocks(cfg, rngs: nnx.Rngs, make_block):
    """`num_hidden_layers` blocks with independent init, stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(layer_rngs):
        return make_block(cfg, rngs=layer_rngs)

    return build(rngs)


def scan_blocks(blocks: nnx.Module, x, opts: RunOptions, layer_fn):
    """Runs `layer_fn(block, x) -> (x, layer_aux)` over the stacked blocks with `lax.scan` (and
    remat, if asked); returns x and the per-layer aux outputs stacked on a leading axis."""
    graphdef, state = nnx.split(blocks)
    names = nnx.get_partition_spec(state)

    def body(h, layer_state):
        if opts.gathered_rules is not None:
            # ZeRO-3: bring this layer's shards together now, just before use.
            layer_names = jax.tree.map(lambda spec: tuple(spec)[1:], names, is_leaf=_is_spec)
            layer_state = jax.tree.map(
                lambda v, n: opts.gathered_rules.constrain(v, n), layer_state, layer_names, is_leaf=_is_spec
            )
        return layer_fn(nnx.merge(graphdef, layer_state), h)

    policy = REMAT_POLICIES[opts.remat]
    if opts.remat != "none":
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, state)


def _is_spec(x):
    return isinstance(x, jax.sharding.PartitionSpec)


class Llama(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        self.layers = stacked_blocks(cfg, rngs, DecoderBlock)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg, rngs=rngs)

    # The three pieces below are what a pipeline stage runs (`jaxpar.parallel.pipeline`): the
    # first stage embeds, every stage runs the blocks it was merged with, the last one projects.
    def embed_tokens(self, tokens, opts: RunOptions):
        return constrain(opts.rules, self.embed(tokens, opts), RESIDUAL)

    def run_layers(self, x, opts: RunOptions):
        """(x, per-layer aux) after every block in `self.layers` (a stage holds only its own)."""
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        inv_freq = rope_inverse_frequencies(self.cfg)
        return scan_blocks(self.layers, x, opts, lambda block, h: block(h, positions, inv_freq, opts))

    def logits_from_hidden(self, x, opts: RunOptions):
        """Final norm + LM head on the last block's output."""
        return project_to_vocab(self.final_norm(x), self.head_weight(), self.cfg.vocab_size, opts)

    def hidden_states(self, tokens, opts: RunOptions):
        """Final-norm hidden states [B, S, D] in the compute dtype, and per-layer aux outputs."""
        x, aux = self.run_layers(self.embed_tokens(tokens, opts), opts)
        return self.final_norm(x), aux

    def head_weight(self):
        return self.embed.weight[...].T if self.lm_head is None else self.lm_head.weight[...]

    def __call__(self, tokens, opts: RunOptions):
        """(logits, aux): fp32 logits [B, S, padded vocab], vocab-sharded, padded columns masked;
        aux holds per-layer statistics stacked over layers ({} for dense Llama)."""
        x, aux = self.hidden_states(tokens, opts)
        return project_to_vocab(x, self.head_weight(), self.cfg.vocab_size, opts), aux
