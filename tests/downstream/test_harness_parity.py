"""jaxpar as an lm-eval model equals lm-eval's own transformers backend on the same checkpoint.

One random Llama saved with `save_pretrained` beside a local tokenizer; three local tasks
(`tests/downstream/local_tasks.py`: multiple choice, greedy generation with a stop sequence, rolling
log-likelihood over texts longer than the model's 128 positions). lm-eval's `hf` backend (HFLM, CPU,
float32) and `JaxparLM` on the same folder run the same requests through `simple_evaluate`: every
request's log-likelihood agrees within fp32 rounding, the is-greedy flags and the accuracies exactly,
the generations token for token (as text). And jaxpar on a mesh of 8 devices (data 4 x tensor 2)
gives what it gives on one device.
"""

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's transformers backend imports it
torch = pytest.importorskip("torch")

from jaxpar.downstream import harness  # noqa: E402
from tests.downstream.local_tasks import GEN, MC, ROLLING, TASKS, hf_checkpoint, write_tasks  # noqa: E402

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # nats, per request (fp32 forward of a different implementation)
RELATIVE = 1e-6  # more for the rolling sums of hundreds of tokens (fp32: ~1e-7 each)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    return hf_checkpoint(root / "model"), write_tasks(root / "tasks")


def _evaluate(lm, tasks_folder) -> dict:
    return harness.evaluate(lm, list(TASKS), tasks_folder, log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def transformers_results(setup):
    from lm_eval.models.huggingface import HFLM

    model, tasks = setup
    return _evaluate(HFLM(pretrained=model, device="cpu", dtype="float32", batch_size=4), tasks)


@pytest.fixture(scope="module")
def jaxpar_one_device(setup):
    from jaxpar.loading.lm_eval import JaxparRunLM as JaxparLM

    model, tasks = setup
    lm = JaxparLM(from_hf=model, data=1, batch_size=8)
    assert len(lm.sampler.mesh.devices.flat) == 1
    return _evaluate(lm, tasks), lm.scorer.shapes


def _responses(results, task):
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def _scores(results, task) -> list[tuple[float, bool | None]]:
    """Every request's (log-likelihood, is-greedy) in document order (is-greedy None for rolling)."""
    out = []
    for doc in _responses(results, task):
        for (answer,) in doc:
            out.append((float(answer[0]), bool(answer[1])) if isinstance(answer, (tuple, list)) else (float(answer), None))
    return out


def _max_difference(a, b) -> float:
    """The largest |difference| of two lists of scores, less RELATIVE of the score (fp32 sums grow with length)."""
    assert len(a) == len(b)
    return max(abs(x[0] - y[0]) - RELATIVE * abs(y[0]) for x, y in zip(a, b))


def test_multiple_choice_loglikelihoods_and_accuracies_equal_the_transformers_backend(transformers_results, jaxpar_one_device):
    ours, shapes = jaxpar_one_device
    theirs, mine = _scores(transformers_results, MC), _scores(ours, MC)
    assert len(mine) == 40
    assert _max_difference(theirs, mine) < TOLERANCE
    assert [g for _, g in mine] == [g for _, g in theirs]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][MC][metric] == transformers_results["results"][MC][metric]
    assert len(shapes) <= 3, f"a few compiled shapes, not one per request: {sorted(shapes)}"


def test_rolling_loglikelihoods_equal_the_transformers_backend(transformers_results, jaxpar_one_device):
    ours, _ = jaxpar_one_device
    theirs, mine = _scores(transformers_results, ROLLING), _scores(ours, ROLLING)
    assert _max_difference(theirs, mine) < TOLERANCE  # sums over up to 3 windows of 128 tokens
    word, reference = ours["results"][ROLLING]["word_perplexity,none"], transformers_results["results"][ROLLING]["word_perplexity,none"]
    assert word == pytest.approx(reference, rel=1e-5)


def test_greedy_generations_equal_the_transformers_backend(transformers_results, jaxpar_one_device):
    ours, _ = jaxpar_one_device
    assert _responses(ours, GEN) == _responses(transformers_results, GEN)
    texts = [text[0] for doc in _responses(ours, GEN) for text in doc]
    assert any(texts) and not any("brown" in t or "lazy" in t for t in texts), "cut at the task's stop sequences"
    assert ours["results"][GEN]["exact_match,none"] == transformers_results["results"][GEN]["exact_match,none"]


def test_a_mesh_of_8_devices_gives_the_one_device_results(setup, jaxpar_one_device):
    from jaxpar.loading.lm_eval import JaxparRunLM as JaxparLM

    model, tasks = setup
    lm = JaxparLM(from_hf=model, data=4, tensor=2, batch_size=8)
    assert dict(lm.sampler.mesh.shape)["tensor"] == 2 and len(lm.sampler.mesh.devices.flat) == 8
    ours, mesh = jaxpar_one_device[0], _evaluate(lm, tasks)
    for task in (MC, ROLLING):
        assert _max_difference(_scores(mesh, task), _scores(ours, task)) < TOLERANCE
    assert _responses(mesh, GEN) == _responses(ours, GEN)
    assert mesh["results"][MC]["acc,none"] == ours["results"][MC]["acc,none"]
