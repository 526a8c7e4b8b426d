"""Documents, packing, sources and mixtures (`jaxpar.data.packing`, `documents`, `hf_stream`,
`mixture`, `corpus`), each against what it must reproduce:
- the packer: every target of every document appears exactly once over the batches, never one
  across a boundary or on padding; documents of at most a row stay whole; positions restart at 0;
  `packing=False` is one document per row; a resumed packer packs the very same batches;
- jsonl (text source) and parquet ("datasets" source) give the tokenizer's own encoding of every
  record, <s> in front and </s> at the end; `prepare_data.py`'s token file with its offsets sidecar
  gives the same documents; a "datasets" stream resumed mid-file reads on from the next record;
- a mixture's realised proportions are within 4 standard deviations of its weights, its order is
  a function of the seed alone, and a resumed mixture continues identically;
- a held-out share: training and eval documents are disjoint and together are the corpus.
"""

import numpy as np
import pytest

from jaxpar.data.corpus import eval_stream, training_stream
from jaxpar.data.documents import HoldOut, IndexedStream
from jaxpar.data.mixture import MixtureStream
from jaxpar.data.packing import Packer
from jaxpar.parallel.context.sequence import real_targets, segment_positions
from tests.support import tiny
from tests.support.documents import ListStream, make_tokenizer, texts, write_jsonl

ROWS, WIDTH = 4, 17


def _docs(count=60, seed=0, high=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, int(n)).astype(np.int32) for n in rng.integers(2, high, count)]


def _all_batches(docs, packing=True):
    return list(Packer(ListStream(docs), ROWS, WIDTH, packing))


def _pairs(tokens_and_segments):
    """Multiset of (input, target) token pairs that are real targets, from batches [G, 2, W]."""
    found = []
    for batch in tokens_and_segments:
        real = np.asarray(real_targets(batch[:, 1]))
        found += list(zip(batch[:, 0, :-1][real].tolist(), batch[:, 0, 1:][real].tolist()))
    return sorted(found)


def test_packing_trains_every_target_once_and_never_across_documents():
    docs = _docs()
    batches = _all_batches(docs)
    want = sorted(p for d in docs for p in zip(d[:-1].tolist(), d[1:].tolist()))
    assert _pairs(batches) == want
    stacked = np.concatenate(batches)
    for row in stacked:
        tokens, segments = row
        for seg in np.unique(segments[segments > 0]):
            run = np.flatnonzero(segments == seg)
            assert np.all(np.diff(run) == 1), "a segment is one contiguous run"
        assert np.all(tokens[segments == 0] == 0)
    # Documents that fit a row are never cut.
    whole = {tuple(d.tolist()) for d in docs if len(d) <= WIDTH}
    pieces = {tuple(row[0][row[1] == s].tolist()) for row in stacked for s in np.unique(row[1][row[1] > 0])}
    assert whole <= pieces
    assert np.mean(stacked[:, 1] > 0) > 0.8, "first fit leaves little padding"


def test_positions_restart_at_each_document():
    segments = np.array([[1, 1, 1, 2, 2, 3, 0, 0]])
    np.testing.assert_array_equal(segment_positions(segments), [[0, 1, 2, 0, 1, 0, 0, 1]])


def test_unpacked_is_one_document_per_row_cut_to_the_row():
    docs = _docs(count=9)
    batches = _all_batches(docs, packing=False)
    rows = np.concatenate(batches)[: len(docs)]
    for d, (tokens, segments) in zip(docs, rows):
        n = min(len(d), WIDTH)
        np.testing.assert_array_equal(tokens[:n], d[:n])
        assert set(segments[:n]) == {1} and not segments[n:].any()


def test_packer_resumes_exactly():
    docs = _docs(count=200)
    first = Packer(ListStream(docs), ROWS, WIDTH)
    for _ in range(3):
        next(first)
    state = first.get_state()
    want = [next(first) for _ in range(3)]
    resumed = Packer(ListStream(docs), ROWS, WIDTH)
    resumed.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(resumed), w)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = make_tokenizer(root / "tokenizer")
    lines = texts(40, seed=3)
    jsonl = write_jsonl(root / "jsonl" / "a.jsonl", lines)
    import pyarrow
    import pyarrow.parquet

    for part in range(2):
        table = pyarrow.table({"body": lines[part * 20 : (part + 1) * 20], "n": list(range(20))})
        (root / "parquet").mkdir(exist_ok=True)
        pyarrow.parquet.write_table(table, root / "parquet" / f"part{part}.parquet")
    return {"root": root, "tokenizer": tokenizer, "lines": lines, "jsonl": jsonl}


def _encode(tokenizer_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _data_config(corpus, **data):
    return tiny.with_overrides(tiny.llama(vocab_size=256), {}, data={"tokenizer": corpus["tokenizer"], **data})


def _eval_documents(config):
    return [d.tolist() for d in eval_stream(config)]


def test_jsonl_and_parquet_documents_are_the_tokenizers_encoding(corpus):
    want = [_encode(corpus["tokenizer"], t) for t in corpus["lines"]]
    jsonl = _data_config(corpus, source="text", path=corpus["jsonl"])
    parquet = _data_config(corpus, source="datasets", path=str(corpus["root"] / "parquet" / "*.parquet"),
                           text_field="body")
    for config in (jsonl, parquet):
        config.eval.path = config.data.path
        assert _eval_documents(config) == want


def test_prepared_token_file_has_the_same_documents(corpus):
    from jaxpar.data.prepare import prepare

    out = str(corpus["root"] / "prepared.bin")
    meta = prepare(corpus["tokenizer"], [corpus["jsonl"]], out, progress=False)
    config = _data_config(corpus, source="tokens", path=out, token_dtype=meta["dtype"])
    config.eval.path = out
    assert _eval_documents(config) == [_encode(corpus["tokenizer"], t) for t in corpus["lines"]]


def test_datasets_stream_resumes_at_the_next_record(corpus):
    config = _data_config(corpus, source="datasets", path=str(corpus["root"] / "parquet"), text_field="body")
    stream = training_stream(config)
    for _ in range(27):  # into the second file
        next(stream)
    state = stream.get_state()
    want = [next(stream).tolist() for _ in range(30)]  # across an epoch end
    resumed = training_stream(config)
    resumed.set_state(state)
    assert [next(resumed).tolist() for _ in range(30)] == want


def test_mixture_proportions_order_and_resume():
    weights, draws = [3.0, 1.0, 0.5], 6000
    streams = lambda: [ListStream([[i, i]] * draws) for i in range(3)]  # noqa: E731
    mix = MixtureStream(streams(), weights, seed=5)
    sources = np.array([next(mix)[0] for _ in range(draws)])
    p = np.asarray(weights) / sum(weights)
    counts = np.bincount(sources, minlength=3)
    sigma = np.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(counts - draws * p) <= 4 * sigma), (counts, draws * p)
    again = MixtureStream(streams(), weights, seed=5)
    assert [next(again)[0] for _ in range(500)] == sources[:500].tolist()
    other = MixtureStream(streams(), weights, seed=6)
    assert [next(other)[0] for _ in range(500)] != sources[:500].tolist()
    state = again.get_state()
    resumed = MixtureStream(streams(), weights, seed=5)
    resumed.set_state(state)
    assert [next(resumed)[0] for _ in range(4500)] == sources[500:5000].tolist()
    with pytest.raises(ValueError):
        MixtureStream(streams(), [1.0, 0.0, 1.0], seed=0)


def test_mixture_from_config_reads_both_sources(corpus):
    other = write_jsonl(corpus["root"] / "other.jsonl", texts(40, seed=9, prefix="zebra"))
    config = _data_config(corpus, source="text", mixture=f"{corpus['jsonl']}:1,{other}:1")
    stream = training_stream(config)
    assert isinstance(stream, MixtureStream)
    docs = [next(stream) for _ in range(60)]
    assert len({tuple(d.tolist()) for d in docs}) > 30
    assert stream.get_state()["draws"] == 60 and len(stream.get_state()["sources"]) == 2


def test_held_out_share_is_disjoint_from_training(corpus):
    config = _data_config(corpus, source="text", path=corpus["jsonl"])
    config.eval.share = 0.3
    held = {tuple(d) for d in _eval_documents(config)}
    all_docs = {tuple(_encode(corpus["tokenizer"], t)) for t in corpus["lines"]}
    stream = training_stream(config)
    trained = {tuple(next(stream).tolist()) for _ in range(200)}
    assert held and trained and not held & trained
    assert held | trained == all_docs
    assert HoldOut(0.0, eval=False)(np.arange(3)) and not HoldOut(0.0, eval=True)(np.arange(3))


def test_indexed_stream_rejects_a_corpus_without_usable_documents():
    from jaxpar.data.documents import DataError

    stream = IndexedStream([np.array([1], np.int32)] * 3, seed=0, train=True, name="data.path")
    with pytest.raises(DataError, match="data.path"):
        next(stream)
