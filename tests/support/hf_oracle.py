"""The training oracle's transformers models (tests/train/test_oracle.py, tests/data/test_packed_oracle.py),
one or more per jaxpar family, and the bridge from their HF-named tensors into jaxpar's layout.

Weights are drawn with a large std and norm weights away from 1, as in tests/support/hf_models.py.
The Qwen models are the interop parity cases (tests/support/hf_models.py `QWEN_CASES`: QK-norm,
dense layers among MoE layers, the shared expert and its gate, tied embeddings), with a large aux
coefficient as for Mixtral.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import save_file  # noqa: E402

from jaxpar.interop import hf  # noqa: E402
from tests.support.hf_models import QWEN_CASES, deepseek_config, qwen_config, randomized  # noqa: E402


def qwen_oracle_config(case: str):
    """A Qwen interop case; its MoE families with a large aux coefficient, as `mixtral_aux`."""
    return qwen_config(case, **({} if QWEN_CASES[case][0] == "qwen3" else {"router_aux_loss_coef": 0.5}))


BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-5,
            max_position_embeddings=64, attn_implementation="eager")
MODELS = {
    "llama_gqa_untied": lambda: transformers.LlamaConfig(vocab_size=300, num_key_value_heads=2, **BASE),
    "llama_gqa_tied": lambda: transformers.LlamaConfig(vocab_size=200, num_key_value_heads=2, tie_word_embeddings=True, **BASE),
    # A large aux coefficient, so the load-balancing loss moves the router's gradient visibly.
    "mixtral_aux": lambda: transformers.MixtralConfig(
        vocab_size=300, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, **BASE
    ),
    **{case: (lambda case=case: qwen_oracle_config(case)) for case in QWEN_CASES},
    # MLA with a query latent, YaRN, interleaved RoPE; a dense layer, then group-limited routing with
    # selection biases (transformers' DeepSeek-V3 has no load-balancing loss).
    "deepseek_v3_q_lora_yarn_groups": lambda: deepseek_config("q_lora_yarn_groups", attn_implementation="eager"),
    # Gemma 3: sliding (window 4 < 16 tokens) then full, scores scaled by 24^-1/2; no pad token (torch
    # would never update its embedding row, which jaxpar has no notion of).
    "gemma3_text_window": lambda: transformers.Gemma3TextConfig(
        vocab_size=300, num_key_value_heads=2, head_dim=16, sliding_window=4, sliding_window_pattern=2,
        query_pre_attn_scalar=24, pad_token_id=None, **BASE,
    ),
    # gpt-oss: sliding (window 4 < 16 tokens) then full, sinks, every bias, YaRN, the SwiGLU clamp at
    # 2, a large aux coefficient as for Mixtral; the experts' eager loop (training mode's default is
    # a grouped matmul kernel).
    "gpt_oss_sinks_biases": lambda: transformers.GptOssConfig(
        vocab_size=300, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=2.0, router_aux_loss_coef=0.5,
        experts_implementation="eager", **BASE,
    ),
}


def hf_model(name):
    config = MODELS[name]()
    torch.manual_seed(0)
    model = randomized(transformers.AutoModelForCausalLM.from_config(config))
    randomize_selection_biases(model)
    return model.float().train()


def randomize_selection_biases(model):
    """DeepSeek-V3's `e_score_correction_bias` buffers (model state, not parameters) drawn N(0, 0.1²)
    from torch's generator, so they change which experts are chosen."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)


def routes(model) -> bool:
    """Whether a transformers model has routed experts and a load-balancing loss (with `output_router_logits`)."""
    config = model.config
    return getattr(config, "num_experts_per_tok", None) is not None and getattr(config, "router_aux_loss_coef", None) is not None


def as_jaxpar(model, tensors: dict, directory):
    """HF-named numpy tensors (weights or their gradients) in jaxpar's layout, by jaxpar's own reader
    (checked against transformers' logits in tests/interop/test_hf_*.py)."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**model.config.to_dict(), "architectures": [type(model).__name__]}))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return hf.load(directory)


def weights(model) -> dict:
    """Every tensor of the checkpoint: the parameters and the persistent buffers (selection biases)."""
    return {n: p.detach().numpy().copy() for n, p in model.state_dict().items()}


def gradients(model) -> dict:
    """The parameters' gradients, and zeros for the persistent buffers (model state: jaxpar's step
    takes their gradient slots out, `jaxpar.models.state`)."""
    params = dict(model.named_parameters())
    return {n: params[n].grad.numpy() if n in params else np.zeros(t.shape, np.float32) for n, t in model.state_dict().items()}
