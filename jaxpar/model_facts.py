"""What the rest of jaxpar may know about a model without building it.

Each family computes its `ModelFacts` from its `config.model` (`jaxpar.models.families.facts`):
sizes, parameter counts, whether it is a mixture of experts, and the forward matmul FLOPs of one
token by part — its own formulas, so a family with a different attention or MLP says what that
costs. This module combines them into the one FLOP model everything reads:

- `layer_flops` / `vocab_flops`: hardware FLOPs of a layer and of the vocab work per token, which
  the pipeline's auto stage split balances (`jaxpar.parallel.pipeline.balance`) and the cost model
  splits over devices (`jaxpar.analysis.cost.cost_model`);
- `model_flops_per_step`: model FLOPs for MFU (`jaxpar.train.observe`, `scripts/bench.py`), the
  convention the peer benchmark uses (6·N·T with N the matmul parameters a token touches, plus
  causal attention), so achieved GFLOP/s compare across systems.

Plain numbers, no jax: the parallel and analysis code read facts without importing the models.
The derived dimensions every layer agrees on (the padded vocab, the head dim) live here too.
"""

from __future__ import annotations

import dataclasses
import math

# Stored vocab rows/columns are padded to a multiple of this (zeros, masked in the loss). It is a
# constant, not a function of the mesh, so parameter shapes and initial values never depend on it.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def head_dim_of(model) -> int:
    """`model.head_dim`, or hidden_size / num_attention_heads when it is None (transformers' rule)."""
    return model.head_dim if model.head_dim is not None else model.hidden_size // model.num_attention_heads


def expert_capacity(seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots each expert has for one sequence's tokens: ceil(S·k / E · factor), at most S (an
    expert never gets a token twice); 0 for dropless (factor 0)."""
    if factor <= 0:
        return 0
    return max(1, min(seq_len, math.ceil(seq_len * top_k / num_experts * factor)))


@dataclasses.dataclass(frozen=True)
class MoEFacts:
    experts: int
    top_k: int
    capacity_factor: float  # 0: dropless
    expert_ffn: int  # hidden size of one expert's MLP
    layer_share: float = 1.0  # the fraction of layers that route (dense layers among MoE layers: < 1)
    shared_ffn: int = 0  # hidden size of the shared expert every token runs (0: none)

    def capacity(self, seq_len: int) -> int:
        return expert_capacity(seq_len, self.top_k, self.experts, self.capacity_factor)

    def routed_rows(self, seq_len: int) -> float:
        """Expert rows computed per token: k dropless; with a capacity every expert runs all of
        its C slots per sequence, E·C / S per token."""
        if self.capacity_factor <= 0:
            return float(self.top_k)
        return self.experts * self.capacity(seq_len) / seq_len


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    family: str  # `model.model_type`
    layers: int  # decoder blocks a training step runs (with multi-token prediction's: one routed block per depth)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the dense MLP's hidden size (0: the layer has none besides its experts)
    vocab_size: int
    vocab: int  # padded, as stored
    tied_embeddings: bool
    moe: MoEFacts | None  # None: dense
    params_total: int
    params_active: int  # matmul parameters one token touches (no embedding lookup; experts k/E; a tied table once, as the head)
    # Forward matmul FLOPs per token of one decoder layer, by part (the family's formulas). With
    # dense layers among MoE layers, `flops_mlp` is the mean over all layers and the routed parts
    # are those of one routing layer, weighted by `MoEFacts.layer_share`.
    flops_q_o: float  # query and output projections (split over tensor with the heads)
    flops_k_v: float  # key and value projections (split over tensor only when the KV heads are)
    flops_attention_per_key: float  # QKᵀ and PV for one (query, key) pair, all heads
    flops_mlp: float  # the dense MLP, or a MoE layer's shared expert and its gate (0 for a purely routed layer)
    flops_expert_row: float  # one routed row through one expert (0 dense)
    flops_router: float  # the router's projection in a routing layer (0 dense)
    flops_head: float  # the LM head per token (each multi-token prediction depth runs it once more)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3): no matmul FLOPs, more saved activations
    # Multi-head latent attention (DeepSeek-V3): its down-projections into the latents, which every
    # tensor rank runs whole, and the latents' widths, where tensor parallelism reduces the
    # attention's input gradients (instead of at the layer input, once per q / k / v projection).
    flops_latent: float = 0.0
    latent_widths: tuple = ()
    table_uses: int = 1  # lookups of the embedding and uses of the LM head per token (multi-token prediction: 1 + depth)
    kv_latent_width: int = 0  # numbers per token the keys and values are expanded from (MLA: kv latent + RoPE key); 0: none
    # Blocks the pipeline stages (0: `layers`); the others run on its end stages (DeepSeek-V3's
    # leading dense layers on the first, its prediction modules on the last: `jaxpar.parallel.pipeline.stage`).
    staged_layers: int = 0
    # Sliding-window attention (`jaxpar.models.attention_pattern`): this many layers see only the last
    # `sliding_window` tokens (a query and the window - 1 before it); the others attend causally to all.
    sliding_layers: int = 0
    sliding_window: int = 0
    # cuDNN's fused kernel runs the attention (False: sinks or logit soft-capping, which it lacks,
    # take the XLA path under attention_impl cudnn: `jaxpar.models.attention_pattern.attend`).
    cudnn_attention: bool = True

    @property
    def pipeline_layers(self) -> int:
        """Blocks split over the pipeline's stages."""
        return self.staged_layers or self.layers

    @property
    def is_moe(self) -> bool:
        """Routed experts: the layer reports router statistics and the loss adds the family's
        auxiliary losses, sums over whole microbatches (`jaxpar.parallel.data.gradient_strategy`)."""
        return self.moe is not None

    def layer_flops(self, seq_len: int) -> float:
        """Forward matmul FLOPs per token of one layer, attending to all `seq_len` keys (what XLA's
        attention computes), with the routed experts at their computed rows."""
        share = self.moe.layer_share if self.moe else 0.0
        experts = self.flops_expert_row * self.moe.routed_rows(seq_len) * share if self.moe else 0.0
        return float(
            self.flops_q_o + self.flops_k_v + self.flops_latent + self.flops_attention_per_key * seq_len + self.flops_mlp
            + self.flops_router * share + experts
        )

    def vocab_flops(self) -> float:
        """Forward FLOPs per token of the embedding lookup, final norm, LM head and loss."""
        return float(self.flops_head + 4 * self.vocab + 5 * self.hidden)

    def visible_keys(self, seq_len: int) -> float:
        """Keys a query sees, summed over the layers: S/2 per causal layer (half of all pairs), and per
        sliding layer the mean over positions of min(position + 1, W) = W - W(W-1)/(2S) (S ≥ W)."""
        full = seq_len / 2
        window = self.sliding_window
        sliding = full if window <= 0 or window >= seq_len else window - window * (window - 1) / (2 * seq_len)
        return (self.layers - self.sliding_layers) * full + self.sliding_layers * sliding

    def model_flops_per_step(self, batch: int, seq_len: int) -> float:
        """Training model FLOPs per step for MFU: 6·N·T for the matmuls (N = `params_active`) plus
        attention, 3 × the forward FLOPs of every (query, key) pair a query sees (`visible_keys`:
        6·L·T·S·D when the heads span the hidden size and every layer is causal over all)."""
        tokens = batch * seq_len
        attention = 3 * self.layers * tokens * self.flops_attention_per_key * seq_len / 2
        if self.sliding_layers:  # (without windows exactly the expression it always was)
            attention = 3 * tokens * self.flops_attention_per_key * self.visible_keys(seq_len)
        return 6 * self.params_active * tokens + attention
