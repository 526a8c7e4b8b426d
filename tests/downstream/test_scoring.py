"""The batched log-likelihoods (`jaxpar.downstream.scoring.Scorer`) against one plain forward per
request, and the `eval.harness_*` keys' checks and records.

The reference cuts each request itself (context + continuation, the last max_length + 1 tokens),
runs `jaxpar.models.forward` on that one row alone (no padding, no batch, no length bucket) and
takes numpy's log-softmax of the continuation's targets. The requests cover short ones, a
one-token context, one longer than max_length (cut from the left) and a batch that does not fill.
"""

import numpy as np
import pytest

from jaxpar import models
from jaxpar.downstream import harness
from jaxpar.downstream.scoring import Scorer
from jaxpar.sampling import Sampler
from tests.support import tiny

MAX_LENGTH = 40


def _reference(model_config, params, context, continuation) -> tuple[float, bool]:
    whole = (context + continuation)[-(MAX_LENGTH + 1):]
    logits = np.asarray(models.forward(model_config, params, np.asarray([whole[:-1]], np.int32)))[0].astype(np.float64)
    logprobs = logits - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    targets = np.asarray(whole[1:])
    rows = np.arange(len(targets))[-len(continuation):]
    return float(logprobs[rows, targets[rows]].sum()), bool((logits[rows].argmax(-1) == targets[rows]).all())


def test_batched_loglikelihoods_equal_one_forward_per_request():
    config = tiny.llama()
    params = models.init_params(config.model, 0)
    rng = np.random.default_rng(0)
    requests = [([int(t) for t in rng.integers(0, 250, n)], [int(t) for t in rng.integers(0, 250, m)])
                for n, m in ((5, 3), (1, 1), (12, 7), (50, 4), (9, 1))]
    greedy_context = requests[2][0]  # a continuation that is the model's own argmax: is-greedy must say True
    first = int(np.asarray(models.forward(config.model, params, np.asarray([greedy_context], np.int32)))[0, -1].argmax())
    requests.append((greedy_context, [first]))
    scorer = Scorer(Sampler(config.model), MAX_LENGTH, rows=4)
    found = scorer.loglikelihoods(scorer.sampler.place(params), requests)
    for (context, continuation), (logprob, greedy) in zip(requests, found):
        want, want_greedy = _reference(config.model, params, context, continuation)
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
    assert found[-1][1], "the model's own argmax continuation is greedy"
    assert scorer.shapes == {(4, 40), (4, 16)}, "rows of 4; lengths bucketed (the longest capped at max_length)"


def _harness_config(**keys):
    config = tiny.llama()
    config.eval.update(keys)
    return config


@pytest.mark.parametrize("keys, message", [
    (dict(harness_every_steps=-1), "eval.harness_every_steps=-1 must be >= 0"),
    (dict(harness_limit=-2), "eval.harness_limit=-2 must be >= 0"),
    (dict(harness_include_path="/no/such/folder"), "eval.harness_include_path='/no/such/folder' is not a folder"),
    (dict(harness_every_steps=5), "eval.harness_every_steps=5 but eval.harness_tasks is empty"),
])
def test_bad_harness_keys_are_one_line_each(keys, message):
    errors = harness.checks(_harness_config(**keys))
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_the_harness_is_off_by_default_and_its_checks_pass():
    config = _harness_config()
    assert not harness.enabled(config) and harness.checks(config) == [] and harness.task_problems(config) == []


def test_a_record_names_task_metric_and_filter_without_standard_errors():
    results = {"results": {"b": {"alias": "b", "acc,none": 0.5, "acc_stderr,none": 0.1},
                           "a": {"exact_match,strict-match": 1, "exact_match_stderr,strict-match": 0.0, "name": "a"}}}
    assert harness.record(7, results) == {"step": 7, "harness/a/exact_match/strict-match": 1.0, "harness/b/acc": 0.5}
