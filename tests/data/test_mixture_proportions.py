"""`data.mixture`: every source is read, from its own files with its own settings, in its proportion.

Each source's documents carry token ids no other source uses (token files: a block of ids >= 256;
a text source: bytes, which are < 256), and each document's first token says which document it is.
The mixture is given the two ways a user writes it, read by the command line's own code
(`jaxpar.command.config_file`): a config file's list of dicts (`--config=FILE`), its entries
overriding the data settings (a uint32 token file; a jsonl text source with its own text field),
and the flag `--config.data.mixture=PATH:WEIGHT,...`. Then `training_stream` (what training packs)
is drawn DRAWS documents and each document is traced to the one source whose ids it holds.

Proportions: the count of source i is Binomial(DRAWS, w_i / Σw) (the mixture draws its source
per document independently); Bernstein's inequality with a union bound over the sources gives each
count a bound whose false-failure probability is at most 1e-6 per mixture. Every document of every
source is drawn (each source's stream is a reshuffled permutation per epoch, and each source gets
more draws than it has documents).

Planted once (see the commit): every entry reading the first entry's files fails here.
"""

import json
import math

import numpy as np
import pytest

from jaxpar.command.config_file import apply_overrides, load_config
from jaxpar.data.checks import corpus_problems
from jaxpar.data.corpus import training_stream

FALSE_FAILURE = 1e-6
DOCUMENTS = 40  # per token source
# Documents drawn: grain's shuffled index costs ~1.5 ms per document here, so a few thousand.
DICT_DRAWS, FLAG_DRAWS = 3000, 2000
EOS = 0


def token_source(path, first_id: int, dtype: str, seed: int) -> set[int]:
    """A token file of DOCUMENTS documents ended by EOS; document j is [first_id + j, then 2..9 ids in
    first_id .. first_id + 99, EOS]. Returns its ids (without EOS)."""
    rng = np.random.default_rng(seed)
    docs = [[first_id + j, *rng.integers(first_id, first_id + 100, rng.integers(2, 10)), EOS] for j in range(DOCUMENTS)]
    np.asarray([t for d in docs for t in d], dtype).tofile(path)
    return set(range(first_id, first_id + 100))


LETTERS = "abcdefghijklmnopqrst"  # 20 text documents, document j is letter j repeated j + 3 times


def text_source(path) -> set[int]:
    """A jsonl file whose records hold their text under "body" (not the default "text")."""
    path.write_text("".join(json.dumps({"body": letter * (j + 3), "id": j}) + "\n" for j, letter in enumerate(LETTERS)))
    return {ord(c) for c in LETTERS}


def write_config_file(path, mixture) -> None:
    path.write_text(
        "from jaxpar.config import base_config\n\n\n"
        "def get_config():\n"
        "    c = base_config()\n"
        "    c.model.vocab_size = 1024\n"
        "    c.data.source = 'tokens'\n"
        f"    c.data.eos_id = {EOS}\n"
        "    c.train.seq_len, c.train.global_batch_size = 16, 2\n"
        f"    c.data.mixture = {mixture!r}\n"
        "    return c\n"
    )


def bernstein_bound(p: np.ndarray, n: int, events: int, false_failure: float = FALSE_FAILURE) -> np.ndarray:
    """t with P(some |count_i / n - p_i| >= t_i) <= false_failure over `events` sources."""
    log_term = math.log(2 * events / false_failure)
    return (2 * log_term / 3 + np.sqrt((2 * log_term / 3) ** 2 + 8 * n * log_term * p * (1 - p))) / (2 * n)


def draw_sources(config, ids_of: list[set[int]], draws: int) -> tuple[np.ndarray, list[set[int]]]:
    """(documents per source, first tokens seen per source) over `draws` documents of the training stream."""
    stream = training_stream(config)
    counts, seen = np.zeros(len(ids_of), int), [set() for _ in ids_of]
    for _ in range(draws):
        doc = next(stream)
        body = set(doc.tolist()) - {EOS}
        owners = [i for i, ids in enumerate(ids_of) if body <= ids]
        assert len(owners) == 1, f"a document of ids {sorted(body)} belongs to no single source"
        counts[owners[0]] += 1
        seen[owners[0]].add(int(doc[0]))
    return counts, seen


def assert_mixture_read(config, ids_of, weights, documents, draws):
    assert corpus_problems(config) == []
    counts, seen = draw_sources(config, ids_of, draws)
    p = np.asarray(weights, float) / sum(weights)
    bound = bernstein_bound(p, draws, len(weights))
    shares = counts / draws
    print(f"shares {np.round(shares, 4).tolist()} for {np.round(p, 4).tolist()} (bound ±{np.round(bound, 4).tolist()})")
    assert np.all(np.abs(shares - p) <= bound), (shares.tolist(), p.tolist(), bound.tolist())
    assert [len(s) for s in seen] == documents, "every document of every source is read"


def test_a_list_of_dicts_in_a_config_file(tmp_path):
    """Three sources with weights 1 : 2 : 5, two of them overriding the data settings."""
    ids_of = [
        token_source(tmp_path / "a.bin", 300, "uint16", seed=1),
        token_source(tmp_path / "b.bin", 500, "uint32", seed=2),
        text_source(tmp_path / "c.jsonl"),
    ]
    weights = [1.0, 2.0, 5.0]
    mixture = [
        {"path": str(tmp_path / "a.bin"), "weight": weights[0]},
        {"path": str(tmp_path / "b.bin"), "weight": weights[1], "token_dtype": "uint32"},
        {"path": str(tmp_path / "c.jsonl"), "weight": weights[2], "source": "text", "text_field": "body"},
    ]
    write_config_file(tmp_path / "config.py", mixture)
    config = load_config(str(tmp_path / "config.py"))
    assert_mixture_read(config, ids_of, weights, [DOCUMENTS, DOCUMENTS, len(LETTERS)], draws=DICT_DRAWS)


@pytest.mark.parametrize("weights", [(3.0, 1.0, 0.5), pytest.param((1.0, 1.0), marks=pytest.mark.slow)], ids=["3_1_0.5", "equal_pair"])
def test_the_flag_form(tmp_path, weights):
    """`--config.data.mixture=PATH:WEIGHT,...` over a config file without a mixture."""
    paths = [tmp_path / f"s{i}.bin" for i in range(len(weights))]
    ids_of = [token_source(path, 300 + 150 * i, "uint16", seed=i) for i, path in enumerate(paths)]
    write_config_file(tmp_path / "config.py", "")
    config = load_config(str(tmp_path / "config.py"))
    apply_overrides(config, [("data.mixture", ",".join(f"{path}:{w:g}" for path, w in zip(paths, weights)))])
    assert_mixture_read(config, ids_of, list(weights), [DOCUMENTS] * len(weights), draws=FLAG_DRAWS)


def test_the_bound_tells_the_weights_apart():
    """Power, in closed form: at these sizes a mixture drawn uniformly, or with its weights reversed,
    is off by more than three bounds for some source."""
    for weights, draws in [((1.0, 2.0, 5.0), DICT_DRAWS), ((3.0, 1.0, 0.5), FLAG_DRAWS)]:
        p = np.asarray(weights) / sum(weights)
        bound = bernstein_bound(p, draws, len(p))
        for wrong in (np.full(len(p), 1 / len(p)), p[::-1]):
            assert np.max(np.abs(wrong - p) / bound) > 3
