"""`jaxpar.sampling` on meshes, its filters and its input checks.

Meshes: the same greedy tokens on every supported layout as on one device (tensor splitting heads
and the cache, KV heads repeated when tensor exceeds them, data splitting the prompts, expert
running the MoE dispatch), with a batch that does not divide the batch axes. Filters: over many
draws from a peaked distribution, top-k / top-p never emit a token outside the allowed set, which
is computed here independently (numpy), and every allowed token does occur.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.mesh import make_mesh
from jaxpar.sampling import SampleError, Sampler, SamplingParams
from jaxpar.sampling.filters import choose, filtered_logits, problems
from tests.support import tiny
from tests.support.tiers import slow_except

NEW_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 240], [42], [7, 7, 7, 1, 2, 3, 4, 5, 6], [200, 100], [11, 12, 13]]


def mesh_of(**sizes):
    config = tiny.llama().mesh
    config.update({"data": 1, **sizes})
    n = int(np.prod(list(sizes.values()))) if sizes else 1
    return make_mesh(config, jax.devices()[:n])


@pytest.fixture(scope="module")
def llama():
    cfg = tiny.llama().model
    params = models.init_params(cfg, 1)
    # Larger weights than the init's: decisive argmaxes, so layouts cannot flip a token by rounding.
    params = jax.tree.map(lambda p: p * 6 if p.ndim > 1 else p, params)
    sampler = Sampler(cfg)
    return cfg, params, sampler.generate(sampler.place(params), PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def mixtral():
    cfg = tiny.mixtral().model
    params = jax.tree.map(lambda p: p * 6 if p.ndim > 1 else p, models.init_params(cfg, 2))
    sampler = Sampler(cfg)
    return cfg, params, sampler.generate(sampler.place(params), PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize(
    "sizes",
    slow_except([dict(tensor=2), dict(tensor=4), dict(data=2, tensor=2), dict(data=4), dict(data=2, expert=2, tensor=2)],
                dict(data=2, tensor=2)),
    ids=lambda s: "_".join(f"{k}{v}" for k, v in s.items()),
)
def test_llama_same_greedy_tokens_on_every_mesh(llama, sizes):
    cfg, params, reference = llama
    sampler = Sampler(cfg, mesh_of(**sizes))
    result = sampler.generate(sampler.place(params), PROMPTS, NEW_TOKENS)
    assert result.completions == reference.completions
    assert result.rows % (sizes.get("data", 1) * sizes.get("expert", 1)) == 0
    # The cache is split: batch over data x expert, KV heads over tensor (repeated up to tensor's
    # ranks when fewer: 2 KV heads under tensor 4 are 4 heads of which each rank holds one).
    one_device = Sampler(cfg).cache_bytes_per_device(result.rows, result.slots)
    kv_repeat = max(1, sizes.get("tensor", 1) // cfg.num_key_value_heads)
    split = sizes.get("data", 1) * sizes.get("expert", 1) * sizes.get("tensor", 1)
    assert result.cache_bytes_per_device * split == one_device * kv_repeat


@pytest.mark.parametrize("sizes", slow_except([dict(expert=2), dict(expert=4, tensor=2)], dict(expert=2)),
                         ids=["expert2", "expert4_tensor2"])
def test_mixtral_same_greedy_tokens_on_every_mesh(mixtral, sizes):
    cfg, params, reference = mixtral
    sampler = Sampler(cfg, mesh_of(**sizes))
    assert sampler.generate(sampler.place(params), PROMPTS, NEW_TOKENS).completions == reference.completions


@pytest.fixture(scope="module")
def deepseek_v3():
    cfg = tiny.deepseek_v3().model
    params = jax.tree.map(lambda p: p * 6 if p.ndim > 1 else p, models.init_params(cfg, 3))
    sampler = Sampler(cfg)
    return cfg, params, sampler.generate(sampler.place(params), PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("sizes", slow_except([dict(data=2, tensor=2), dict(data=2, expert=2, tensor=2)], dict(data=2, tensor=2)),
                         ids=["data2_tensor2", "data2_expert2_tensor2"])
def test_deepseek_v3_same_greedy_tokens_on_every_mesh_from_a_latent_cache(deepseek_v3, sizes):
    """MLA decodes from each token's latent and RoPE key (kv_lora_rank + qk_rope_head_dim numbers per
    layer), shared by the heads: split over the batch axes, not over tensor, which splits the heads."""
    cfg, params, reference = deepseek_v3
    sampler = Sampler(cfg, mesh_of(**sizes))
    result = sampler.generate(sampler.place(params), PROMPTS, NEW_TOKENS)
    assert result.completions == reference.completions
    tokens = result.rows * result.slots
    latent = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32 bytes per token
    assert Sampler(cfg).cache_bytes_per_device(result.rows, result.slots) == tokens * latent
    assert result.cache_bytes_per_device * sizes["data"] * sizes.get("expert", 1) == tokens * latent
    heads = cfg.num_attention_heads
    expanded = cfg.num_hidden_layers * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    print(f"cache bytes per token: latent {latent}, expanded k and v {expanded} ({expanded / latent:.1f}x)")


def test_reference_is_not_degenerate(llama, mixtral, deepseek_v3):
    for _, _, result in (llama, mixtral, deepseek_v3):
        assert len({t for c in result.completions for t in c}) > 10


def test_meshes_it_cannot_use_are_refused_in_one_line():
    cfg = tiny.llama().model
    for sizes, match in [(dict(pipeline=2), "mesh.pipeline=2"), (dict(context=2), "mesh.context=2")]:
        with pytest.raises(SampleError, match=match) as error:
            Sampler(cfg, mesh_of(**sizes))
        assert "\n" not in str(error.value)
    odd = tiny.llama(num_attention_heads=6, num_key_value_heads=2).model
    with pytest.raises(SampleError, match="model.num_attention_heads=6 is not divisible by mesh.tensor=4"):
        Sampler(odd, mesh_of(tensor=4))


def test_input_problems_name_the_argument(llama):
    cfg, params, _ = llama
    sampler = Sampler(cfg)
    assert sampler.input_problems(PROMPTS, 8) == []
    too_long = [[1] * (cfg.max_position_embeddings + 1)]
    assert "longer than model.max_position_embeddings=64" in sampler.input_problems(too_long, 1)[0]
    assert "ask for at most 54" in sampler.input_problems([[1] * 10], 60)[0]
    assert "outside [0, 250)" in sampler.input_problems([[1, 250]], 4)[0]
    with pytest.raises(SampleError, match="max_new_tokens=0"):
        sampler.generate(params, PROMPTS, 0)
    assert problems(SamplingParams(temperature=-1.0), 250) == ["--temperature=-1.0 must be >= 0 (0: greedy)"]
    assert "--top_p=0.0 must be in (0, 1]" in problems(SamplingParams(1.0, top_p=0.0), 250)[0]
    assert "--top_p=1.5" in problems(SamplingParams(1.0, top_p=1.5), 250)[0]
    assert "--top_k=300" in problems(SamplingParams(1.0, top_k=300), 250)[0]


def test_seeded_sampling_is_reproducible_and_seed_dependent(llama):
    cfg, params, _ = llama
    sampler = Sampler(cfg)
    placed = sampler.place(params)
    sampling = SamplingParams(temperature=1.5, top_k=50, top_p=0.95)
    first = sampler.generate(placed, PROMPTS, 16, sampling, seed=7).completions
    assert sampler.generate(placed, PROMPTS, 16, sampling, seed=7).completions == first
    assert sampler.generate(placed, PROMPTS, 16, sampling, seed=8).completions != first


def test_eos_stops_a_row():
    cfg = tiny.llama().model
    params = jax.tree.map(lambda p: p * 6 if p.ndim > 1 else p, models.init_params(cfg, 1))
    sampler = Sampler(cfg)
    free = sampler.generate(sampler.place(params), PROMPTS[:1], 12).completions[0]
    eos = free[3]
    stopped = sampler.generate(sampler.place(params), PROMPTS[:1], 12, eos_id=eos).completions[0]
    assert stopped == free[: free.index(eos) + 1]


# -- filters ----------------------------------------------------------------------------------

DRAWS = 20000
# A peaked distribution over 40 tokens: a few likely ones, a long tail (shuffled ids).
LOGITS = np.random.default_rng(0).permutation(np.concatenate([[6.0, 5.5, 5.0, 4.0, 3.0], np.linspace(2.0, -3.0, 35)]))


def draws(params: SamplingParams, seed: int = 0) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (DRAWS, LOGITS.size))
    return np.asarray(jax.jit(choose, static_argnums=1)(logits, params, jnp.uint32(seed), 0))


def allowed(temperature: float, top_k: int, top_p: float) -> set[int]:
    """The allowed set, computed independently: sort, keep k, keep the nucleus."""
    order = np.argsort(-LOGITS, kind="stable")
    keep = order[:top_k] if top_k else order
    scaled = LOGITS[keep] / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    return set(keep[mass_before < top_p].tolist())


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 3, 1.0), (1.0, 0, 0.8), (0.7, 10, 0.9), (2.0, 0, 0.5), (1.0, 1, 1.0)])
def test_filters_never_emit_outside_the_allowed_set(temperature, top_k, top_p):
    expected = allowed(temperature, top_k, top_p)
    seen = set(draws(SamplingParams(temperature, top_k, top_p)).tolist())
    assert seen <= expected, sorted(seen - expected)
    assert seen == expected  # and every allowed token does occur (the filter is not too strict)
    assert len(expected) < LOGITS.size  # the filter removed something


def test_positive_control_unfiltered_draws_reach_the_tail():
    seen = set(draws(SamplingParams(1.0)).tolist())
    assert len(seen) > len(allowed(1.0, 0, 0.8)) + 5


def test_filtered_logits_keep_the_order_and_remove_the_rest():
    out = np.asarray(filtered_logits(jnp.asarray(LOGITS[None], jnp.float32), SamplingParams(1.0, top_k=5)))[0]
    top = set(np.argsort(-LOGITS)[:5].tolist())
    assert {i for i in range(LOGITS.size) if out[i] > -1e30} == top
