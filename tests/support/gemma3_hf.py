"""The random tiny transformers Gemma 3 the gemma3_text tests share (tests/interop/test_hf_gemma3.py,
tests/sampling/test_sampling_hf.py): layers sliding / full / sliding (`sliding_window_pattern` 2)
with a window of 4, the two RoPE bases (the full layer's with linear scaling),
`query_pre_attn_scalar` 24 (not head_dim), the final logit soft-cap at 5, tied embeddings, every
weight random (tests/support/hf_models.py `randomized`; norms U(0.5, 1.5): scales 1 + weight).
`gemma3_multimodal_model` holds that text model inside the released checkpoints' class,
Gemma3ForConditionalGeneration, beside a one-layer SigLIP vision tower."""

import pytest

from tests.support.hf_models import randomized

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW, VOCAB = 4, 300


def gemma3_config(**overrides):
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=WINDOW, sliding_window_pattern=2,
        query_pre_attn_scalar=24, final_logit_softcapping=5.0, rms_norm_eps=1e-6, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )
    return transformers.Gemma3TextConfig(**{**fields, **overrides})


def gemma3_model(overrides: dict | None = None):
    """The model of `gemma3_config(**overrides)` with random weights (seed 0), eval mode."""
    torch.manual_seed(0)
    return randomized(transformers.Gemma3ForCausalLM(gemma3_config(**(overrides or {})))).eval()


def gemma3_multimodal_model():
    """Gemma3ForConditionalGeneration around `gemma3_config()`, random weights (seed 0), eval mode."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=gemma3_config().to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    return randomized(transformers.Gemma3ForConditionalGeneration(config)).eval()
