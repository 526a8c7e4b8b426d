"""Tiny random transformers models for the parity tests (tests/interop/test_hf_*.py and the sampling test
against `generate`): Llama and Mixtral, one per named case.

Weights are drawn with a large std (routers included, so routing is decisive) and norm weights away
from 1, so a swapped or mis-laid-out tensor moves the logits by far more than a test's tolerance.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)

LLAMA_CASES = {
    # GQA, untied, vocab not a multiple of 128.
    "gqa_untied": dict(vocab_size=300, num_attention_heads=4, num_key_value_heads=2),
    # MQA, tied embeddings.
    "mqa_tied": dict(vocab_size=200, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    # llama3 RoPE scaling, head_dim 24 != 64 / 4, vocab exactly 256.
    "llama3_head_dim": dict(
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3_ROPE),
    ),
}


def llama_model(case: str, dtype=torch.float32):
    overrides = dict(LLAMA_CASES[case])
    overrides.setdefault("rope_parameters", dict(rope_type="default", rope_theta=10000.0))
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    return model.to(dtype).eval()


MIXTRAL_CASES = {
    # 4 experts, top-2, GQA, untied, vocab not a multiple of 128.
    "e4_top2": dict(vocab_size=300, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2),
    # 8 experts, top-3, MQA, tied embeddings, head_dim 24 != 64 / 4.
    "e8_top3_tied": dict(
        vocab_size=256, num_local_experts=8, num_experts_per_tok=3, num_key_value_heads=1, head_dim=24,
        tie_word_embeddings=True,
    ),
}


def mixtral_model(case: str):
    config = transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        router_aux_loss_coef=0.02,
        attn_implementation="eager",
        **MIXTRAL_CASES[case],
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    return model.eval()
