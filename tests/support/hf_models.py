"""Tiny random transformers models for the parity tests (tests/interop/test_hf_*.py, the sampling test
against `generate`, the training oracle): every jaxpar family, one per named case.

Weights are drawn with a large std (routers included, so routing is decisive) and norm weights away
from 1, so a swapped or mis-laid-out tensor moves the logits by far more than a test's tolerance.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)


def randomized(model):
    """`model` with every weight redrawn from torch's generator as it stands (the callers seed it
    before building the model): N(0, 0.2²), norm scales U(0.5, 1.5)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    return model


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
    overrides.setdefault("rope_parameters", DEFAULT_ROPE)
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
    return randomized(model).to(dtype).eval()


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
        rope_parameters=DEFAULT_ROPE,
        router_aux_loss_coef=0.02,
        attn_implementation="eager",
        **MIXTRAL_CASES[case],
    )
    torch.manual_seed(0)
    return randomized(transformers.MixtralForCausalLM(config)).eval()


# transformers' config and model classes of each Qwen family.
QWEN_ARCH = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}
# Each case exercises one feature: QK-norm with head_dim != hidden / heads, GQA / MQA, tied embeddings,
# many experts with `norm_topk_prob` on and off, dense layers among MoE layers (`mlp_only_layers`,
# `decoder_sparse_step`), the shared expert with its sigmoid gate, q/k/v biases.
QWEN_CASES = {
    # GQA, untied, vocab not a multiple of 128, head_dim 24 != 64 / 4.
    "qwen3_gqa_head_dim": ("qwen3", dict(vocab_size=300, num_key_value_heads=2, head_dim=24)),
    # MQA, tied embeddings.
    "qwen3_mqa_tied": ("qwen3", dict(vocab_size=256, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)),
    # 16 fine-grained experts, top-4 renormalised, GQA, head_dim 24.
    "qwen3_moe_e16_top4_norm": (
        "qwen3_moe",
        dict(vocab_size=300, num_key_value_heads=2, head_dim=24, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    ),
    # A dense layer between two MoE layers (mlp_only_layers), top-k weights not renormalised, tied.
    "qwen3_moe_dense_layer_tied": (
        "qwen3_moe",
        dict(
            vocab_size=256, num_key_value_heads=2, num_hidden_layers=3, mlp_only_layers=[1], num_experts=8,
            num_experts_per_tok=2, tie_word_embeddings=True,
        ),
    ),
    # Shared expert with its sigmoid gate, q/k/v biases, GQA.
    "qwen2_moe_shared_qkv_bias": (
        "qwen2_moe", dict(vocab_size=300, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
    ),
    # decoder_sparse_step 2: layers 0 and 2 dense, 1 and 3 MoE; no biases, top-k renormalised, tied.
    "qwen2_moe_sparse_step2_tied": (
        "qwen2_moe",
        dict(
            vocab_size=256, num_key_value_heads=4, num_hidden_layers=4, decoder_sparse_step=2, qkv_bias=False,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True,
        ),
    ),
}
QWEN_MOE_SIZES = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, router_aux_loss_coef=0.02)


def qwen_config(case: str, **overrides):
    """The transformers config of a Qwen case (`overrides` on top, e.g. a larger aux coefficient)."""
    family, case_overrides = QWEN_CASES[case]
    kwargs = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-5,
        max_position_embeddings=128, rope_parameters=DEFAULT_ROPE, attn_implementation="eager",
    )
    kwargs.update(case_overrides)
    if family != "qwen3":
        kwargs.update({k: v for k, v in QWEN_MOE_SIZES.items() if family == "qwen2_moe" or not k.startswith("shared")})
    kwargs.update(overrides)
    return getattr(transformers, QWEN_ARCH[family][0])(**kwargs)


def qwen_model(case: str, **overrides):
    config = qwen_config(case, **overrides)
    torch.manual_seed(0)
    return randomized(getattr(transformers, QWEN_ARCH[QWEN_CASES[case][0]][1])(config)).eval()


# DeepSeek-V3: each case exercises features of MLA and its routing. YaRN's context is 4 × 32 = the
# 128 positions transformers expects of its factor.
DEEPSEEK_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
    beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
)
DEEPSEEK_CASES = {
    # Queries through a latent, YaRN with its softmax-scale correction, interleaved RoPE pairs; a dense
    # layer then two routed ones, 8 experts in 4 groups (top-2 among the experts of the 2 best groups).
    "q_lora_yarn_groups": dict(
        vocab_size=300, q_lora_rank=32, rope_parameters=DEEPSEEK_YARN, first_k_dense_replace=1, num_hidden_layers=3,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
    ),
    # Queries projected directly, plain RoPE without interleaving, value heads larger than the query
    # heads (32 > 16 + 8), every layer routed, no group limit, weights not renormalised, two shared
    # experts, tied embeddings.
    "q_direct_tied": dict(
        vocab_size=256, q_lora_rank=None, rope_parameters=DEFAULT_ROPE, rope_interleave=False, v_head_dim=32,
        first_k_dense_replace=0, num_hidden_layers=2, n_routed_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=3, norm_topk_prob=False, n_shared_experts=2, tie_word_embeddings=True,
    ),
}


def deepseek_config(case: str, **overrides):
    kwargs = dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, moe_intermediate_size=32, n_shared_experts=1,
        routed_scaling_factor=2.5, rms_norm_eps=1e-5, max_position_embeddings=128, num_nextn_predict_layers=0,
        attn_implementation="eager",
    )
    kwargs.update(DEEPSEEK_CASES[case])
    kwargs.update(overrides)
    return transformers.DeepseekV3Config(**kwargs)


def deepseek_model(case: str, **overrides):
    """A random DeepSeek-V3 case, its selection biases (`e_score_correction_bias`, a buffer) drawn too:
    N(0, 0.1²) against sigmoid scores in (0, 1), so they change which experts are chosen."""
    config = deepseek_config(case, **overrides)
    torch.manual_seed(0)
    model = randomized(transformers.DeepseekV3ForCausalLM(config))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.eval()
