"""Multi-token prediction (DeepSeek-V3 §2.2): D modules after the main model, depth k predicting token
i + k + 1 from position i.

Depth k combines the previous depth's output h (the main model's last block output, before its
final norm, for k = 1) with the embedding of token i + k: [RMSNorm(embedding); RMSNorm(h)] (in
that order, as transformers' `MtpLayer` and DeepSeek's weights) projected back to the hidden size
by `eh_proj` (FP8 matmul `mtp_proj` under `train.fp8`: a plain linear, which DeepSeek-V3 trained in
FP8 too), then one decoder block (MLA and a routed MoE MLP: transformers builds MTP blocks with
`first_k_dense_replace` 0), whose output goes on to depth k + 1 and, through the module's own
RMSNorm (`shared_head.norm`), to the shared LM head. Every depth attends causally within the same
packed documents as the main model, at the same positions.

The modules are stacked on a leading `depth` axis (replicated, never staged: with `mesh.pipeline` > 1
the last stage runs them, `jaxpar.parallel.pipeline.stage`) and run one depth at a time with the
decoder's layer scan (remat and ZeRO-3 gathering as for the layers). They run only
when the caller passes the tokens ahead (`jaxpar.models.apply(..., ahead=...)`: training with
`train.mtp_loss_weight` > 0); inference and evaluation never do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.kernels.dense import project
from jaxpar.models.decoder import DecoderBlock, scan_blocks
from jaxpar.models.fp8_state import fp8_args, histories
from jaxpar.models.layers import RMSNorm, normal_init, project_to_vocab
from jaxpar.models.options import RunOptions
from jaxpar.sharding import RESIDUAL, constrain


class PredictionModule(nnx.Module):
    """One depth: the two norms, `eh_proj` [2D, D], a decoder block and the head's norm."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, make_attention, make_mlp):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nnx.Param(normal_init(rngs, (2 * d, d), cfg.initializer_range), out_sharding=(None, "embed"))
        self.fp8_history = histories(cfg, 1)  # eh_proj's, under delayed FP8 scaling (else None)
        self.block = DecoderBlock(cfg, rngs=rngs, make_attention=make_attention, make_mlp=make_mlp)
        self.norm = RMSNorm(d, eps)

    def __call__(self, h, embedded, positions, inv_freq, opts: RunOptions, segment_ids=None):
        """(this depth's output [B, S, D], the block's MLP aux) from the previous depth's h and the
        embedded tokens ahead."""
        joined = jnp.concatenate([self.enorm(embedded), self.hnorm(h)], axis=-1)
        fp8 = fp8_args(opts, "mtp_proj", self.fp8_history, 0)
        x = project(joined, self.eh_proj[...], splits_sequence=opts.plan.splits_sequence, **fp8)
        return self.block(constrain(opts.rules, x, RESIDUAL), positions, inv_freq, opts, segment_ids)


def prediction_modules(cfg, rngs: nnx.Rngs, make_attention, make_mlp):
    """`num_nextn_predict_layers` modules with independent init, stacked on a leading `depth` axis."""

    @nnx.split_rngs(splits=cfg.num_nextn_predict_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "depth"})
    def build(depth_rngs):
        return PredictionModule(cfg, rngs=depth_rngs, make_attention=make_attention, make_mlp=make_mlp)

    return build(rngs)


def predict_ahead(model, x, ahead, positions, inv_freq, opts: RunOptions, segment_ids, aux):
    """`aux` with "ahead_logits" [D, B, S, padded vocab] and the modules' router statistics appended
    to the layers' (one more MoE layer per depth). `model`: the decoder holding `mtp`; x: its last
    block's output; `ahead` [D, B, S]: token i + k of position i at depth k."""
    head, tied = model.head_weight(), model.lm_head is None
    logits, stats, h = [], [], x
    for depth in range(ahead.shape[0]):
        embedded = model.embed_tokens(ahead[depth], opts)

        def run(module, h, embedded=embedded):
            out, layer_aux = module(h, embedded, positions, inv_freq, opts, segment_ids)
            return out, (project_to_vocab(module.norm(out), head, model.cfg.vocab_size, opts, tied=tied), layer_aux)

        h, (depth_logits, depth_stats) = scan_blocks(model.mtp, h, opts, run, span=(depth, depth + 1))
        logits.append(depth_logits[0])
        stats.append(depth_stats)
    joined = jax.tree.map(lambda *parts: jnp.concatenate(parts), aux, *stats)
    return {**joined, "ahead_logits": jnp.stack(logits)}
