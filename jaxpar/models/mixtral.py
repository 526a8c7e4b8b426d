"""Mixtral: Llama's attention, norms, embeddings and layer scan, with a sparse MoE block as MLP.

`Mixtral.__call__` (inherited) returns (logits, aux) with aux the per-layer router statistics
stacked over layers; `Mixtral.aux_losses` turns them into the loss terms and metrics the train
step adds (`jaxpar.models.moe`).
"""

from __future__ import annotations

from flax import nnx

from jaxpar.models import register
from jaxpar.models.layers import Embedding, LMHead, RMSNorm
from jaxpar.models.llama import DecoderBlock, Llama, stacked_blocks
from jaxpar.models.moe import MoEBlock, aux_losses


def moe_decoder_block(cfg, *, rngs: nnx.Rngs) -> DecoderBlock:
    return DecoderBlock(cfg, rngs=rngs, make_mlp=MoEBlock)


class Mixtral(Llama):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        # Same structure (and creation order) as Llama; only the decoder blocks' MLP differs.
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        self.layers = stacked_blocks(cfg, rngs, moe_decoder_block)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg, rngs=rngs)

    aux_losses = staticmethod(aux_losses)


register("mixtral", Mixtral)
