"""The random tiny transformers gpt-oss the gpt_oss tests share (tests/interop/test_hf_gpt_oss.py,
tests/sampling/test_sampling_hf.py): 3 layers sliding / full / sliding with a window of 4, sinks,
every bias, YaRN (gpt-oss's: the ramp not truncated), 4 experts top-2 with the SwiGLU clamp at 2
so that it acts; eager attention and the experts' eager loop (the math transformers documents);
every weight random (tests/support/hf_models.py `randomized`: routers and biases included)."""

import pytest

from tests.support.hf_models import randomized

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
WINDOW, VOCAB = 4, 300


def gpt_oss_config(**overrides):
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, max_position_embeddings=64, swiglu_limit=2.0, rms_norm_eps=1e-5,
        attn_implementation="eager", experts_implementation="eager",
    )
    return transformers.GptOssConfig(**{**fields, **overrides})


def gpt_oss_model(overrides: dict | None = None):
    """The model of `gpt_oss_config(**overrides)` with random weights (seed 0), eval mode."""
    torch.manual_seed(0)
    return randomized(transformers.GptOssForCausalLM(gpt_oss_config(**(overrides or {})))).eval()
