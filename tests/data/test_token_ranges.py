"""Token ids must lie in [0, model.vocab_size): every id of a small token file is checked, evenly
spaced blocks (first and last included) of a large one. The sizes are shrunk here so "large" is
10,000 ids; the planted bad ids are the reference."""

import numpy as np
import pytest

from jaxpar.data import sources


def token_file(path, ids, dtype="uint16") -> str:
    np.asarray(ids, dtype).tofile(path)
    return str(path)


@pytest.fixture
def small_limits(monkeypatch):
    monkeypatch.setattr(sources, "RANGE_FULL_TOKENS", 1000)
    monkeypatch.setattr(sources, "RANGE_SAMPLE_BLOCKS", 5)
    monkeypatch.setattr(sources, "RANGE_BLOCK_TOKENS", 10)


def test_small_file_is_checked_in_full(tmp_path):
    ids = np.full(999, 7)
    ids[517] = 256
    (line,) = sources.token_range_problems(token_file(tmp_path / "t.bin", ids), "uint16", 256)
    assert "holds token id 256 at position 517, not below model.vocab_size=256 (checked all 999 ids)" in line
    assert sources.token_range_problems(token_file(tmp_path / "ok.bin", np.full(999, 255)), "uint16", 256) == []


def test_negative_ids_of_a_signed_file(tmp_path):
    ids = np.full(50, 3)
    ids[-1] = -2
    (line,) = sources.token_range_problems(token_file(tmp_path / "t.bin", ids, "int32"), "int32", 256)
    assert "holds negative token id -2 at position 49" in line and "check data.token_dtype" in line


def test_large_file_is_sampled_in_blocks(tmp_path, small_limits):
    count = 10_000
    starts = np.linspace(0, count - 10, 5).astype(int)  # 0, 2497, 4995, 7492, 9990
    assert list(starts) == [0, 2497, 4995, 7492, 9990]
    for position, found in [(0, True), (2500, True), (9999, True), (1000, False)]:
        ids = np.full(count, 1)
        ids[position] = 5000
        problems = sources.token_range_problems(token_file(tmp_path / f"t{position}.bin", ids), "uint16", 256)
        assert bool(problems) == found, (position, problems)
        if found:
            assert f"at position {position}" in problems[0] and "(checked 5 sampled blocks of 10000 ids)" in problems[0]
