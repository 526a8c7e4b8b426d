"""Data pipeline: global batches are a function of (tokens, seq_len, G, seed, step) only."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import MESH_AXES
from jaxpar.config import base_config
from jaxpar.data import (
    BatchIterator,
    ByteTokenizer,
    GlobalBatches,
    global_batch,
    load_tokens,
    process_rows,
    validate_data_config,
)

SEQ, G = 15, 8


def _batches(num_windows=64, seed=0, seq=SEQ, g=G):
    # Window i holds i*(seq+1) .. : its first token identifies it.
    return GlobalBatches(np.arange(num_windows * (seq + 1), dtype=np.int32), seq, g, seed)


def _data_config(**kw):
    data = base_config().data
    data.update(kw)
    return data


def _batch_sharding(shape, names):
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)
    return NamedSharding(mesh, P(("data", "expert")))


# ---- batches ----


def test_rows_shape_and_shifted_windows():
    b = _batches()
    rows = b.rows(0)
    assert rows.shape == (G, SEQ + 1) and rows.dtype == np.int32
    # each row is one contiguous, window-aligned slice of the stream
    assert np.all(np.diff(rows, axis=1) == 1) and np.all(rows[:, 0] % (SEQ + 1) == 0)


@pytest.mark.parametrize(
    "shape,names",
    [
        ((8, 1), ("data", "expert")),
        ((1, 8), ("data", "expert")),
        ((2, 4), ("data", "expert")),
        ((4, 2), ("data", "expert")),
        ((2, 1, 1, 2, 2), MESH_AXES),  # batch replicated over tensor
        ((1, 2, 1, 4, 1), MESH_AXES),  # batch replicated over pipeline
    ],
)
def test_global_batch_independent_of_mesh(shape, names):
    b = _batches()
    single = NamedSharding(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert")), P(("data", "expert")))
    sharding = _batch_sharding(shape, names)
    for step in (0, 3, 11):
        ref = np.asarray(global_batch(b, step, single))
        np.testing.assert_array_equal(ref, b.rows(step))
        arr = global_batch(b, step, sharding)
        assert arr.shape == (G, SEQ + 1) and arr.dtype == np.int32 and arr.sharding == sharding
        np.testing.assert_array_equal(np.asarray(arr), ref)
        for shard in arr.addressable_shards:  # every device holds exactly its slice
            np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])


def test_process_rows_whole_batch_in_one_process():
    assert process_rows(_batch_sharding((2, 4), ("data", "expert")), (G, SEQ + 1)) == (0, G)


@pytest.mark.parametrize("splits", [[0, 8], [0, 4, 8], [0, 2, 4, 6, 8], [0, 1, 3, 8], list(range(9))])
def test_per_process_slices_assemble_to_global_batch(splits):
    b = _batches()
    for step in (0, 5):
        parts = [b.rows(step, lo, hi) for lo, hi in zip(splits[:-1], splits[1:])]
        np.testing.assert_array_equal(np.concatenate(parts), b.rows(step))


class _FakeSharding:
    """Stands in for a NamedSharding seen from one process of a multi-process run."""

    def __init__(self, spans):
        self.spans = spans

    def addressable_devices_indices_map(self, shape):
        return {i: (slice(lo, hi), slice(None)) for i, (lo, hi) in enumerate(self.spans)}


def test_process_rows_simulated_processes():
    shape = (G, SEQ + 1)
    assert process_rows(_FakeSharding([(2, 4), (4, 6)]), shape) == (2, 6)
    assert process_rows(_FakeSharding([(4, 6), (4, 6)]), shape) == (4, 6)  # replicas
    with pytest.raises(ValueError, match="non-contiguous"):
        process_rows(_FakeSharding([(0, 2), (4, 6)]), shape)


def test_steps_and_seeds_differ():
    b0, b1 = _batches(seed=0), _batches(seed=1)
    assert not np.array_equal(b0.rows(0), b0.rows(1))
    assert not np.array_equal(b0.rows(0), b1.rows(0))
    np.testing.assert_array_equal(b0.rows(7), _batches(seed=0).rows(7))  # rebuilt: same


def test_every_epoch_covers_every_window_once():
    windows = 64
    b = _batches(num_windows=windows)
    steps_per_epoch = windows // G
    orders = []
    for epoch in range(3):
        steps = range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
        firsts = np.concatenate([b.rows(s)[:, 0] for s in steps])
        ids = firsts // (SEQ + 1)
        assert sorted(ids.tolist()) == list(range(windows))
        orders.append(ids)
    assert not np.array_equal(orders[0], orders[1])  # reshuffled each epoch


def test_trailing_partial_window_dropped():
    b = GlobalBatches(np.arange(10 * (SEQ + 1) + SEQ, dtype=np.int32), SEQ, 2, 0)
    assert b.num_windows == 10


def test_corpus_too_small_names_keys():
    with pytest.raises(ValueError, match=r"train\.seq_len.*data\.max_corpus_bytes"):
        GlobalBatches(np.arange(7 * (SEQ + 1), dtype=np.int32), SEQ, G, 0)


def test_batch_iterator_resumes_from_state():
    b = _batches()
    it = BatchIterator(b)
    first = [next(it) for _ in range(5)]
    assert it.get_state() == {"step": 5}
    later = [next(it) for _ in range(3)]
    resumed = BatchIterator(b)
    resumed.set_state({"step": 5})
    for want in later:
        np.testing.assert_array_equal(next(resumed), want)
    np.testing.assert_array_equal(first[2], b.rows(2))


def test_batch_iterator_with_sharding():
    b = _batches()
    it = BatchIterator(b, _batch_sharding((4, 2), ("data", "expert")), step=2)
    arr = next(it)
    assert isinstance(arr, jax.Array)
    np.testing.assert_array_equal(np.asarray(arr), b.rows(2))
    assert it.get_state() == {"step": 3}


# ---- tokenizer ----


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "hello, wörld — 数据 🚀\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < tok.vocab_size == 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode(text.encode("utf-8")), ids)
    assert tok.decode(ids[:-2]).endswith("\ufffd")  # a cut character is replaced, not an error


# ---- sources ----


def test_stdlib_corpus_deterministic():
    data = _data_config(source="stdlib", max_corpus_bytes=50_000)
    a, b = load_tokens(data), load_tokens(data)
    assert a.ndim == 1 and len(a) == 50_000 and a.max() < 256
    np.testing.assert_array_equal(a, b)
    text = ByteTokenizer().decode(a)
    assert "import" in text or "def " in text


def test_text_file_and_folder(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("abc")
    np.testing.assert_array_equal(load_tokens(_data_config(source="text", path=str(f))), [97, 98, 99])

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("B")
    (folder / "a.txt").write_text("A")
    (folder / "sub" / "c.py").write_text("C")
    (folder / ".hidden").write_text("H")
    got = ByteTokenizer().decode(load_tokens(_data_config(source="text", path=str(folder))))
    assert got == "A\n\nB\n\nC"


def test_token_file_memmap(tmp_path):
    path = tmp_path / "tokens.bin"
    want = np.arange(1000, dtype=np.uint16) * 7
    want.tofile(path)
    got = load_tokens(_data_config(source="tokens", path=str(path), token_dtype="uint16"))
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    rows = GlobalBatches(got, SEQ, 4, 0).rows(0)
    assert rows.dtype == np.int32 and np.all(rows % 7 == 0)


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_missing_path_names_data_path(tmp_path, source):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"data\.path='.*nope' does not exist; set data\.path"):
        load_tokens(_data_config(source=source, path=missing))
    with pytest.raises(ValueError, match=r"data\.path is empty"):
        load_tokens(_data_config(source=source, path=""))


def test_other_source_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source"):
        load_tokens(_data_config(source="web"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"data\.path"):
        load_tokens(_data_config(source="text", path=str(tmp_path / "empty.txt")))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"data\.token_dtype"):
        load_tokens(_data_config(source="tokens", path=str(tmp_path / "odd.bin"), token_dtype="uint16"))


def test_validate_data_config(tmp_path):
    config = base_config()
    assert validate_data_config(config) == []

    def errors(**data):
        c = base_config()
        c.data.update(data)
        return validate_data_config(c)

    assert any("data.source" in e for e in errors(source="web"))
    assert any("data.path" in e for e in errors(source="text", path=""))
    assert any("data.path" in e for e in errors(source="tokens", path=str(tmp_path / "nope")))
    assert any("data.token_dtype" in e for e in errors(token_dtype="float32"))
    assert errors(source="text", path=str(tmp_path)) == []

    small = base_config()
    small.model.vocab_size = 100
    msgs = validate_data_config(small)
    assert len(msgs) == 1 and "model.vocab_size" in msgs[0] and "\n" not in msgs[0]
    small.data.update(dict(source="tokens", path=str(tmp_path)))  # a folder: tokens needs a file
    assert [m for m in validate_data_config(small) if "model.vocab_size" in m] == []


def test_suspicious_corpora_are_named_not_silently_accepted(tmp_path):
    from jaxpar.data.sources import corpus_warnings

    ids = np.random.default_rng(0).integers(1, 250, 4000).astype(np.uint32)
    ids.tofile(tmp_path / "wide.bin")  # uint32 ids, no sidecar, read as uint16
    config = _data_config(source="tokens", path=str(tmp_path / "wide.bin"), token_dtype="uint16")
    (warning,) = corpus_warnings(config, load_tokens(config))
    assert warning.startswith(f"data.path={str(tmp_path / 'wide.bin')!r} has no sidecar") and "every second id is 0" in warning
    ids.astype(np.uint16).tofile(tmp_path / "plain.bin")
    config = _data_config(source="tokens", path=str(tmp_path / "plain.bin"), token_dtype="uint16")
    (warning,) = corpus_warnings(config, load_tokens(config))
    assert "has no sidecar" in warning and "every second id" not in warning
    (tmp_path / "plain.bin.json").write_text("{}")
    assert corpus_warnings(config, load_tokens(config)) == []

    (tmp_path / "binary.dat").write_bytes(np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint8).tobytes())
    config = _data_config(source="text", path=str(tmp_path / "binary.dat"))
    (warning,) = corpus_warnings(config, load_tokens(config))
    assert warning.startswith(f"data.path={str(tmp_path / 'binary.dat')!r} looks binary:"), warning
    (tmp_path / "prose.txt").write_text("Zoë's naïve café: plain text, with accents.\n\ttabs and lines\n" * 500)
    config = _data_config(source="text", path=str(tmp_path / "prose.txt"))
    assert corpus_warnings(config, load_tokens(config)) == []


def test_corpus_fingerprint_sees_content_at_the_same_size(tmp_path, monkeypatch):
    from jaxpar.data import sources

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"x" * 3000)
    (folder / "b.txt").write_bytes(b"y" * 5000)
    config = _data_config(source="text", path=str(folder))
    before = sources.corpus_fingerprint(config)
    assert sources.corpus_fingerprint(config) == before
    monkeypatch.setattr(sources, "FINGERPRINT_FULL_BYTES", 1000)  # sampled blocks, not the whole corpus
    monkeypatch.setattr(sources, "FINGERPRINT_BLOCK_BYTES", 100)
    monkeypatch.setattr(sources, "FINGERPRINT_BLOCKS", 8)
    sampled = sources.corpus_fingerprint(config)
    (folder / "b.txt").write_bytes(b"y" * 4999 + b"z")  # the last block is always sampled
    assert sources.corpus_fingerprint(config) != sampled
    monkeypatch.undo()
    assert sources.corpus_fingerprint(config) != before
