"""jaxpar.bench.packing's batches: the packed kinds hold the drawn documents as segments (none longer than
the longest document drawn), several to a row for short documents, and the same batch for the same seed.
The independent reference is the lengths the documents were drawn with (S/16 .. S/4 tokens)."""

import numpy as np

from jaxpar.bench.packing import batch_of
from tests.support import tiny


def runs(row: np.ndarray) -> list[int]:
    """Lengths of the runs of equal nonzero segment ids in a row."""
    cuts = np.flatnonzero(np.diff(row) != 0) + 1
    return [len(piece) for piece in np.split(row, cuts) if piece[0] != 0]


def test_short_documents_pack_several_to_a_row():
    config = tiny.llama()  # rows of S + 1 = 17 tokens
    batch, described = batch_of("short", config)
    assert batch.shape == (config.train.global_batch_size, 2, config.train.seq_len + 1)
    width = config.train.seq_len + 1
    longest = max(width // 4, 2)  # documents of max(2, S/16) .. S/4 tokens
    lengths = [n for row in batch[:, 1] for n in runs(row)]
    assert max(lengths) <= longest and min(lengths) >= 1, lengths  # a document cut at a row's end may be shorter
    per_row = np.mean([len(runs(row)) for row in batch[:, 1]])
    assert per_row >= width / longest - 1 and described.startswith(f"{per_row:.1f} segments a row"), described
    again, _ = batch_of("short", config)
    np.testing.assert_array_equal(batch, again)
    tokens, _ = batch_of("unpacked", config)
    assert tokens.shape == (config.train.global_batch_size, width) and tokens.max() < config.model.vocab_size
