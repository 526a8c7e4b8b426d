"""Greedy sampling (`jaxpar.sampling`) against transformers' `generate(do_sample=False)`, every family.

The same random tiny models as the interop parity tests (large weights: decisive argmaxes): Llama,
Mixtral, Qwen3 with QK-norm (untied and tied), Qwen3-MoE with 16 experts, and with a dense layer between two MoE layers
(the decode cache is split into runs of one kind and joined back in layer order), Qwen2-MoE with
its gated shared expert and q/k/v biases, and with `decoder_sparse_step` 2, DeepSeek-V3 (decoding from
its latent cache with the up-projections absorbed; tests/support/hf_models.py `DEEPSEEK_CASES`),
Gemma 3 with sliding layers keeping only their window (tests/support/gemma3_hf.py), gpt-oss with
its sinks, biases and windows (tests/support/gpt_oss_hf.py). Saved
with `save_pretrained` and read with `jaxpar.interop.hf.load`. Three prompts of different lengths
go through one left-padded batch; transformers generates each on its own (no padding), 64 new
tokens, fp32. Every cached step's logits are also compared with a full forward (no cache) over
the sequence so far.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxpar import models  # noqa: E402
from jaxpar.interop import hf  # noqa: E402
from jaxpar.models.families import FAMILIES  # noqa: E402
from jaxpar.sampling import Sampler  # noqa: E402
from tests.support.gemma3_hf import gemma3_model  # noqa: E402
from tests.support.gpt_oss_hf import gpt_oss_model  # noqa: E402
from tests.support.hf_models import DEEPSEEK_CASES, QWEN_CASES, deepseek_model, llama_model, mixtral_model, qwen_model  # noqa: E402
from tests.support.tiers import slow_except  # noqa: E402

NEW_TOKENS = 64
PROMPT_LENGTHS = (5, 11, 3)

CASES = {
    "llama_gqa_untied": (llama_model, "gqa_untied"),
    "llama_mqa_tied": (llama_model, "mqa_tied"),
    "llama3_rope": (llama_model, "llama3_head_dim"),
    "mixtral_e4_top2": (mixtral_model, "e4_top2"),
    **{case: (qwen_model, case) for case in QWEN_CASES},
    **{f"deepseek_v3_{case}": (deepseek_model, case) for case in DEEPSEEK_CASES},
    # Layers sliding, full, sliding with an 8-token window: prompts of up to 11 tokens and 64 new
    # ones run far past it, the sliding layers on their 8-slot rings (`jaxpar.models.attention_cache`);
    # untied (tied, these random weights repeat 4 tokens).
    "gemma3_text_window8": (gemma3_model, dict(sliding_window=8, final_logit_softcapping=None, max_position_embeddings=128,
                                                 tie_word_embeddings=False)),
    # gpt-oss: sliding, full, sliding with an 8-token window far under the 64 new tokens; sinks, every
    # bias and YaRN in the cached path, the biased experts decoding one token at a time. Slow tier
    # (transformers' generate with the experts' eager loop: 27 s); Gemma 3's case covers the rings.
    "gpt_oss_window8": (gpt_oss_model, dict(sliding_window=8, max_position_embeddings=128)),
}
# The fast tier: one case per family, with the features a planted bug in decoding would break.
FAST = ("llama_gqa_untied", "mixtral_e4_top2", "qwen3_gqa_head_dim", "qwen3_moe_dense_layer_tied", "qwen2_moe_shared_qkv_bias",
        "deepseek_v3_q_lora_yarn_groups", "gemma3_text_window8")


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.as_tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


def test_every_family_is_decoded_against_transformers(tmp_path):
    covered = set()
    for name, (make, case) in CASES.items():
        make(case).config.save_pretrained(tmp_path / name)
        covered.add(hf.model_config(tmp_path / name).model_type)
    assert covered == set(FAMILIES), f"no greedy-decoding case for {sorted(set(FAMILIES) - covered)}"


@pytest.fixture(scope="module", params=slow_except(sorted(CASES), *FAST))
def case(request, tmp_path_factory):
    make, name = CASES[request.param]
    model = make(name)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, params = hf.load(path)
    prompts = prompts_for(cfg.vocab_size)
    sampler = Sampler(cfg)
    result = sampler.generate(sampler.place(params), prompts, NEW_TOKENS, return_logits=True)
    return request.param, model, cfg, params, prompts, result


def test_greedy_tokens_equal_transformers_generate(case):
    name, model, _, _, prompts, result = case
    for prompt, ours in zip(prompts, result.completions):
        expected = hf_greedy(model, prompt)
        assert len(ours) == NEW_TOKENS
        assert ours == expected, f"{name}: first difference at token {next(i for i, (a, b) in enumerate(zip(ours, expected)) if a != b)}"
    # Not a degenerate run: the completions use many different tokens.
    assert len({t for c in result.completions for t in c}) > 10


def test_every_cached_step_equals_a_full_forward(case):
    name, _, cfg, params, prompts, result = case
    worst = 0.0
    for prompt, completion, step_logits in zip(prompts, result.completions, result.logits):
        sequence = np.asarray([prompt + completion])
        full = np.asarray(models.forward(cfg, params, sequence))[0]
        expected = full[len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]
        worst = max(worst, float(np.max(np.abs(step_logits - expected))))
    print(f"{name}: cached vs full forward logits max abs {worst:.2e}")
    assert worst < 1e-4
