"""`data.mixture_stages`: a mixture whose weights change at given train steps (Levanter's weights by stage).

- Without stages the mixture draws what numpy's `Generator.choice` draws from each block's generator:
  what it drew before stages existed, so runs without stages are unchanged.
- Proportions per stage, against theory: with `data.packing=False` every row is one document, so a
  stage of k steps gets exactly n = k × G documents and the count of source i in it is Binomial(n, p_i)
  (one uniform number per draw, independent). Each count must fall in its exact two-sided binomial
  interval (scipy) at a false-failure probability of 1e-6 over all counts together (Bonferroni); a
  weight of 0 gives the interval [0, 0].
- The switch falls on the step, packed, through the config (list and dict-by-name forms): in stages
  that weigh one source only, every document that starts in the stage's batches is that source's,
  the document drawn for the batch before a switch (it did not fit) drawn again.
- Resume mid-stage: after every batch of a staged, packed mixture whose documents span rows and
  batches, the position saved (through JSON, as checkpoints hold it) resumes to the same batches,
  bitwise; and (slow) a training run stopped mid-stage resumes to bitwise the uninterrupted losses.

Planted once each (see the commit): stages ignored, the stage switched one step early or late, the
waiting document not drawn again at a switch, the batch left out of the mixture's or the packer's state.
"""

import json

import numpy as np
import pytest
from scipy import stats

from jaxpar.command.config_file import apply_overrides
from jaxpar.config import base_config
from jaxpar.data.batches import DocumentBatches
from jaxpar.data.corpus import mixture_stages, training_stream
from jaxpar.data.mixture import _SALT, BLOCK, MixtureStream
from jaxpar.data.packing import Packer
from tests.support import files, tiny
from tests.support.documents import documents_in

FALSE_FAILURE = 1e-6


class Endless:
    """Source `i`'s documents, forever: document j has ids 100·(i + 1) + (0..99) and a length of 2 to
    `longest` tokens, both from a generator seeded by (i, j); the state is j."""

    def __init__(self, i: int, longest: int = 2):
        self.i, self.longest, self.j = i, longest, 0

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        rng = np.random.default_rng([self.i, self.j])
        self.j += 1
        return (100 * (self.i + 1) + rng.integers(0, 100, rng.integers(2, self.longest + 1))).astype(np.int32)

    def get_state(self) -> dict:
        return {"j": self.j}

    def set_state(self, state: dict) -> None:
        self.j = state["j"]


def source_of(document: np.ndarray) -> int:
    owners = set((np.asarray(document) // 100 - 1).tolist()) - {-1}  # id 0 (EOS) belongs to no one
    assert len(owners) == 1, f"a document of ids {document.tolist()} belongs to no single source"
    return owners.pop()


def test_without_stages_the_draws_are_numpy_choice_as_before():
    weights, seed, draws = [3.0, 1.0, 0.5], 11, 2 * BLOCK + 100
    mix = MixtureStream([Endless(i) for i in range(3)], weights, seed)
    packer = Packer(mix, rows=7, width=2, packing=False)  # the packer tells the mixture every batch, to no effect
    got = [source_of(d) for batch in (next(packer) for _ in range(draws // 7)) for d in documents_in(batch)]
    p = np.asarray(weights) / sum(weights)
    want = np.concatenate([np.random.default_rng([seed, _SALT, b]).choice(3, size=BLOCK, p=p) for b in range(3)])
    assert got == want[: len(got)].tolist()


def test_each_stage_draws_its_own_weights():
    """Steps 1-60 draw 1:1:2 (data.mixture's weights), 61-120 5:1:0, 121-180 1:3:1; G = 40 rows."""
    rows, steps = 40, 60
    base, stages = [1.0, 1.0, 2.0], [(61, [5.0, 1.0, 0.0]), (121, [1.0, 3.0, 1.0])]
    packer = Packer(MixtureStream([Endless(i) for i in range(3)], base, seed=3, stages=stages), rows, 4, packing=False)
    counts = np.zeros((3, 3), int)
    for b in range(3 * steps):
        for document in documents_in(next(packer)):
            counts[b // steps, source_of(document)] += 1
    n = rows * steps
    p = np.asarray([base] + [w for _, w in stages])
    p /= p.sum(axis=1, keepdims=True)
    low, high = stats.binom.interval(1 - FALSE_FAILURE / counts.size, n, p)
    print(f"counts per stage {counts.tolist()} of {n}; intervals {low.astype(int).tolist()} .. {high.astype(int).tolist()}")
    assert counts.sum(axis=1).tolist() == [n] * 3
    assert np.all((low <= counts) & (counts <= high)), (counts.tolist(), low.tolist(), high.tolist())


def stage_config(tmp_path, stages: str):
    """Two token files (ids 100-199 and 200-299, documents of 2-12 ids ended by EOS 0), named a and b,
    mixed 1:1, rows of 17 tokens, 4 a batch, and `--config.data.mixture_stages=stages`."""
    paths = []
    for i in range(2):
        source = Endless(i, longest=12)
        ids = [int(t) for _ in range(60) for t in (*next(source), 0)]
        paths.append(files.tokens(tmp_path / f"{'ab'[i]}.bin", ids, sidecar={"vocab_size": 300}))
    config = base_config()
    config.model.vocab_size = 300
    config.data.update({"source": "tokens", "eos_id": 0, "mixture": [
        {"path": paths[0], "weight": 1.0, "name": "a"}, {"path": paths[1], "weight": 1.0, "name": "b"}]})
    config.train.seq_len, config.train.global_batch_size = 16, 4
    apply_overrides(config, [("data.mixture_stages", stages)])
    return config


def test_the_switch_falls_on_the_step(tmp_path):
    """Steps 3-5 draw a only, 6-8 b only, 9 on 2:1; every document starting in those steps' batches obeys."""
    config = stage_config(tmp_path, '[[3, {"a": 1, "b": 0}], [6, [0, 1]], [9, {"b": 1, "a": 2}]]')
    assert mixture_stages(config.data) == ([(3, [1.0, 0.0]), (6, [0.0, 1.0]), (9, [2.0, 1.0])], [])
    packer = Packer(training_stream(config), config.train.global_batch_size, config.train.seq_len + 1)
    sources, redrawn = {}, 0
    for step in range(1, 13):
        redrawn += step in (3, 6, 9) and packer.waiting is not None  # a document drawn for step - 1 waits
        sources[step] = {source_of(d) for d in documents_in(next(packer))}
    assert redrawn == 3, "each switch had a waiting document to draw again"
    assert all(sources[s] == {0} for s in (3, 4, 5)) and all(sources[s] == {1} for s in (6, 7, 8)), sources
    assert set().union(*(sources[s] for s in (1, 2))) == {0, 1} and set().union(*(sources[s] for s in range(9, 13))) == {0, 1}


def staged_batches(prefetch: bool) -> DocumentBatches:
    """Documents of 2-45 tokens in rows of 17 (some span three rows, and batches), stages at 3, 5, 8."""
    stages = [(3, [1.0, 0.0, 0.0]), (5, [0.0, 1.0, 2.0]), (8, [1.0, 1.0, 1.0])]
    mix = MixtureStream([Endless(i, longest=45) for i in range(3)], [1.0, 2.0, 1.0], seed=7, stages=stages)
    return DocumentBatches(Packer(mix, rows=3, width=17), prefetch=prefetch)


def test_resume_in_the_middle_of_a_stage_is_exact():
    batches = 12
    reference = staged_batches(prefetch=True)
    want = [next(reference) for _ in range(batches)]
    reference.close()
    continuing = 0
    for stop in range(batches):
        first = staged_batches(prefetch=stop % 2 == 0)
        for _ in range(stop):
            next(first)
        state = json.loads(json.dumps(first.get_state()))  # as a checkpoint holds it
        first.close()
        packer = state["packer"]
        continuing += bool(packer["offset"]) and packer["stream"]["batch"] >= 2  # a long document drawn after step 3
        resumed = staged_batches(prefetch=False)
        resumed.set_state(state)
        got = [next(resumed) for _ in range(batches - stop)]
        assert all(np.array_equal(a, b) for a, b in zip(got, want[stop:], strict=True)), f"resumed after batch {stop}"
    assert continuing >= 2, "resumed inside a long document drawn with a stage's weights"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_stopped_mid_stage_resumes_bitwise(tmp_path):
    from jaxpar.train.loop import train
    from jaxpar.train.observe import TIMING_FIELDS

    data = stage_config(tmp_path, "[[3, [1, 0]], [5, [1, 3]]]").data

    def config(steps: int):
        config = tiny.with_overrides(tiny.llama(vocab_size=300), {"data": 2, "tensor": 4}, checkpoint={"every_steps": 2},
                                     train={"steps": steps, "final_learning_rate_fraction": 1.0})
        config.data = data
        return config

    def losses(workdir):
        with open(workdir / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records if "goodput" not in r]

    train(config(6), str(tmp_path / "reference"), progress=False)
    train(config(3), str(tmp_path / "run"), progress=False)  # stops after step 3, inside the stage of steps 3-4
    history = train(config(6), str(tmp_path / "run"), progress=False)
    assert [r["step"] for r in history] == [4, 5, 6]
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")
