"""How often each token is drawn: `jaxpar.sampling`'s temperature / top-k / top-p against the
distribution they promise, softmax(logits / T) restricted to the allowed set and renormalised.

The oracle is written here in float64 from the definitions (transformers' order: temperature, then
top-k, then top-p; ties at either threshold all kept, as `filters.filtered_logits` promises): token j
survives top-k when fewer than k tokens have a larger scaled logit, and top-p when the tokens strictly
more likely than it hold less than p of the (top-k renormalised) mass.

Each case draws n tokens at once from one logits row repeated n times (independent Gumbel noise per
row) and compares every token's frequency f with its probability q. Bernstein's inequality for a
mean of n independent indicators gives P(|f - q| >= t) <= 2 exp(-n t² / (2 q(1 - q) + 2t / 3));
t is solved for a false-failure probability of 1e-6 per case, shared by a union bound over the
vocabulary. Tokens outside the allowed set must never be drawn. Cases keep every threshold at least
1e-3 of mass (or 1e-2 of a logit) away from a decision, so float32 against float64 cannot flip one.

Planted once each (see the commit): uniform sampling over the allowed set, the temperature ignored,
and the top-p cut off by one (`cumsum < p`, dropping the token that crosses p) all fail here.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.sampling import Sampler, SamplingParams
from jaxpar.sampling.filters import choose
from tests.support import tiny
from tests.support.tiers import slow_except

FALSE_FAILURE = 1e-6
DRAWS = 1 << 18
# 16 tokens, shuffled: a clear head, a tie (2.2, 2.2) at the third place, a long tail.
LOGITS = np.random.default_rng(0).permutation(
    np.array([3.0, 2.6, 2.2, 2.2, 1.5, 1.1, 0.8, 0.4, 0.0, -0.3, -0.7, -1.0, -1.6, -2.0, -2.5, -3.0])
)


def expected_distribution(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 probabilities of each token after temperature, top-k and top-p (0 outside the set)."""
    scaled = np.asarray(logits, np.float64) / temperature
    keep = np.ones(scaled.size, bool)
    if top_k:
        keep &= np.array([np.sum(scaled > s) < top_k for s in scaled])
    probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        keep &= np.array([probs[probs > q].sum() < top_p for q in probs])
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def decision_margin(logits, temperature: float, top_k: int, top_p: float) -> float:
    """How far the case is from a threshold decision: in mass for top-p, in scaled logit for top-k
    (distinct values only: equal logits are a tie, kept together by definition)."""
    scaled = np.asarray(logits, np.float64) / temperature
    margins = [math.inf]
    if top_k:
        levels = np.unique(scaled)[::-1]
        kth = np.sort(scaled)[::-1][top_k - 1]
        below = levels[levels < kth]
        margins.append(kth - below[0] if below.size else math.inf)
    if top_p < 1.0:
        probs = expected_distribution(logits, temperature, top_k, 1.0)
        more_likely = np.array([probs[probs > q].sum() for q in probs[probs > 0]])
        margins.append(float(np.min(np.abs(more_likely - top_p))))
    return min(margins)


def deviation_bound(q: np.ndarray, n: int, tokens: int, false_failure: float = FALSE_FAILURE) -> np.ndarray:
    """Per-token t with P(some |f - q| >= t) <= false_failure (Bernstein, union over `tokens`)."""
    log_term = math.log(2 * tokens / false_failure)
    return (2 * log_term / 3 + np.sqrt((2 * log_term / 3) ** 2 + 8 * n * log_term * q * (1 - q))) / (2 * n)


def assert_frequencies_match(ids: np.ndarray, q: np.ndarray) -> float:
    """Every frequency within its bound, nothing outside the allowed set; returns the worst |f - q| / t."""
    f = np.bincount(ids, minlength=q.size) / ids.size
    outside = np.flatnonzero((q == 0) & (f > 0))
    assert outside.size == 0, f"tokens {outside.tolist()} are outside the allowed set but were drawn"
    bound = deviation_bound(q, ids.size, q.size)
    ratio = np.abs(f - q) / bound
    worst = int(np.argmax(ratio))
    assert ratio[worst] <= 1.0, f"token {worst}: frequency {f[worst]:.4f}, probability {q[worst]:.4f}, bound ±{bound[worst]:.4f}"
    return float(ratio.max())


def mass_of_top(count: int, temperature: float = 1.0) -> float:
    probs = np.sort(expected_distribution(LOGITS, temperature, 0, 1.0))[::-1]
    return float(probs[:count].sum())


_top3 = mass_of_top(3)  # the 3.0 and 2.6 tokens and one of the tied 2.2 pair
CASES = {
    "plain_softmax": (1.0, 0, 1.0),
    "temperature_0.6": (0.6, 0, 1.0),
    "temperature_2_top_k_4": (2.0, 4, 1.0),
    "top_k_3_tie_at_the_cut": (1.0, 3, 1.0),  # the tied pair straddles k: 4 tokens kept
    "top_p_0.75_temperature_1.4": (1.4, 0, 0.75),
    "top_k_6_top_p_0.85_temperature_0.8": (0.8, 6, 0.85),
    # p inside the tied pair's mass: position would keep one of them, value keeps both.
    "top_p_tie_at_the_cut": (1.0, 0, (mass_of_top(2) + _top3) / 2),
    # p 2e-3 of mass below / above the five most likely tokens' mass: 5 and 6 tokens kept.
    "top_p_just_below_a_boundary": (1.0, 0, mass_of_top(5) - 2e-3),
    "top_p_just_above_a_boundary": (1.0, 0, mass_of_top(5) + 2e-3),
}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draws(logits, params: SamplingParams, n: int, seed):
    return choose(jnp.broadcast_to(logits, (n, logits.size)), params, seed, 0)


def draws(logits, params: SamplingParams, n: int = DRAWS, seed: int = 0) -> np.ndarray:
    return np.asarray(_draws(jnp.asarray(logits, jnp.float32), params, n, jnp.uint32(seed)))


def test_the_cases_are_what_they_say():
    """The oracle on its own: sizes of the allowed sets, and no case near a decision."""
    kept = {name: int(np.sum(expected_distribution(LOGITS, *case) > 0)) for name, case in CASES.items()}
    assert kept["top_k_3_tie_at_the_cut"] == 4
    assert kept["top_p_tie_at_the_cut"] == 4
    assert (kept["top_p_just_below_a_boundary"], kept["top_p_just_above_a_boundary"]) == (5, 6)
    assert kept["plain_softmax"] == kept["temperature_0.6"] == LOGITS.size
    for name, case in CASES.items():
        assert decision_margin(LOGITS, *case) >= 1e-3, name


def test_the_bound_rejects_the_wrong_distributions():
    """Power, in closed form: for each wrong sampler, some case's expected frequencies are more than
    twice the bound away from the right ones (so n draws of it fail with overwhelming probability)."""

    def uniform(t, k, p):
        q = expected_distribution(LOGITS, t, k, p)
        return (q > 0) / np.sum(q > 0)

    def off_by_one_top_p(t, k, p):
        q = expected_distribution(LOGITS, t, k, 1.0)
        cumulative = np.array([q[q >= x].sum() for x in q])  # mass up to and including the token
        q = np.where((cumulative < p) | (p >= 1.0), q, 0.0)
        return q / q.sum()

    wrong = {
        "uniform": uniform,
        "temperature ignored": lambda t, k, p: expected_distribution(LOGITS, 1.0, k, p),
        "top-p off by one": off_by_one_top_p,
    }
    for what, sampler in wrong.items():
        gaps = []
        for case in CASES.values():
            q = expected_distribution(LOGITS, *case)
            gaps.append(float(np.max(np.abs(sampler(*case) - q) / deviation_bound(q, DRAWS, q.size))))
        assert max(gaps) > 2, (what, gaps)


# The fast tier: temperature, top-k and top-p together, a tie at the top-p cut, and a boundary.
FAST = ("top_k_6_top_p_0.85_temperature_0.8", "top_p_tie_at_the_cut", "top_p_just_above_a_boundary")


@pytest.mark.parametrize("name", slow_except(sorted(CASES), *FAST))
def test_frequencies_match_the_filtered_softmax(name):
    temperature, top_k, top_p = CASES[name]
    q = expected_distribution(LOGITS, temperature, top_k, top_p)
    worst = assert_frequencies_match(draws(LOGITS, SamplingParams(temperature, top_k, top_p)), q)
    print(f"{name}: {int(np.sum(q > 0))} tokens allowed, worst |f - q| {worst:.2f} of its bound")


# -- the whole engine: prefill, filters and the seeded draw, against the model's own logits ------------

ROWS, SEEDS = 1024, 8  # 8192 draws: one compiled bucket, eight seeds
ENGINE_SAMPLING = SamplingParams(temperature=0.5, top_k=8, top_p=0.9)


def test_first_sampled_token_follows_the_models_logits():
    """`Sampler.generate` with one prompt repeated ROWS times, one new token, SEEDS seeds: the first
    sampled tokens' frequencies against the filtered softmax of the logits the model returned."""
    cfg = tiny.llama().model
    # Larger weights than the init's: a peaked next-token distribution, so the filters cut something.
    params = jax.tree.map(lambda p: p * 10 if p.ndim > 1 else p, models.init_params(cfg, 1))
    sampler = Sampler(cfg)
    placed = sampler.place(params)
    prompt = [5, 17, 99, 3, 240]
    ids, logits = [], None
    for seed in range(SEEDS):
        result = sampler.generate(placed, [prompt] * ROWS, 1, ENGINE_SAMPLING, seed=seed, return_logits=True)
        ids += [c[0] for c in result.completions]
        step = result.logits[:, 0]
        assert np.max(np.abs(step - step[0])) <= 1e-5, "the same prompt in every row"
        logits = step[0] if logits is None else logits
        np.testing.assert_array_equal(step[0], logits)
    case = (ENGINE_SAMPLING.temperature, ENGINE_SAMPLING.top_k, ENGINE_SAMPLING.top_p)
    assert decision_margin(logits, *case) >= 1e-3
    q = expected_distribution(logits, *case)
    assert 3 <= np.sum(q > 0) < 8, "top-p cuts inside top-k"
    worst = assert_frequencies_match(np.asarray(ids), q)
    print(f"engine: {int(np.sum(q > 0))} tokens allowed, largest probability {q.max():.3f}, worst |f - q| {worst:.2f} of its bound")
