"""Parameter counts and forward FLOPs of the decoder parts families share, for their facts.

A family's `facts(model)` (`jaxpar/models/<family>/costs.py`) adds its MLP or experts to these and
returns a `jaxpar.model_facts.ModelFacts`. Counts follow the modules in `jaxpar.models.layers`
exactly; tests/models/test_families.py checks every family's `params_total` against its parameter tree.
"""

from __future__ import annotations

from jaxpar.model_facts import ModelFacts, MoEFacts, head_dim_of, padded_vocab_size
from jaxpar.models.attention_pattern import cudnn_runs, layer_windows


def attention_params(model) -> int:
    """q, k, v and o of one layer: [D, H, hd], 2 × [D, Hkv, hd], [H, hd, D]."""
    d, h, kv, hd = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, head_dim_of(model)
    return 2 * d * hd * (h + kv)


def norm_params(model) -> int:
    """The block's two RMSNorm scales."""
    return 2 * model.hidden_size


def swiglu_params(hidden: int, ffn: int) -> int:
    """gate, up [D, F] and down [F, D]."""
    return 3 * hidden * ffn


def qk_norm_params(model) -> int:
    """Per-head RMSNorm scales of q and k (Qwen3's QK-norm): two [head_dim]."""
    return 2 * head_dim_of(model)


def decoder_facts(
    model, *, layer_params: int, active_layer_params: int, flops_mlp: float, moe: MoEFacts | None = None,
    flops_expert_row: float = 0.0, flops_router: float = 0.0, ffn: int | None = None,
    stack_params: tuple[int, int] | None = None, qk_norm: bool = False,
) -> ModelFacts:
    """Facts of a decoder stack whose layers hold `layer_params` parameters (`active_layer_params`
    of them touched per token) around the shared embedding, final norm and LM head. Layers of two
    kinds (dense among MoE): `stack_params` = (total, active) over all layers instead, and the
    per-layer FLOPs are means over the layers (`MoEFacts.layers` says how many route)."""
    d, h, kv, hd = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, head_dim_of(model)
    layers, vocab = model.num_hidden_layers, padded_vocab_size(model.vocab_size)
    in_layers, active_in_layers = stack_params or (layers * layer_params, layers * active_layer_params)
    table = vocab * d
    head = 0 if model.tie_word_embeddings else table
    windows = layer_windows(model)
    total = in_layers + table + d + head
    # The embedding lookup is no matmul; a tied table is the head's matmul.
    active = active_in_layers + d + table
    return ModelFacts(
        family=model.model_type,
        layers=layers,
        hidden=d,
        heads=h,
        kv_heads=kv,
        head_dim=hd,
        ffn=model.intermediate_size if ffn is None else ffn,
        vocab_size=model.vocab_size,
        vocab=vocab,
        tied_embeddings=bool(model.tie_word_embeddings),
        moe=moe,
        params_total=total,
        params_active=active,
        flops_q_o=4.0 * d * h * hd,
        flops_k_v=4.0 * d * kv * hd,
        flops_attention_per_key=4.0 * h * hd,
        flops_mlp=float(flops_mlp),
        flops_expert_row=float(flops_expert_row),
        flops_router=float(flops_router),
        flops_head=2.0 * d * vocab,
        qk_norm=qk_norm,
        sliding_layers=int((windows > 0).sum()),
        sliding_window=int(windows.max(initial=0)),
        cudnn_attention=cudnn_runs(model),
    )
