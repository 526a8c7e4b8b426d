"""Documents: every local source as a random-access collection of documents, and a stream over one.

A collection has `__len__`, `__getitem__(i)` (document i's token ids, int32, read and tokenized
on access: nothing is held in memory but an index) and `size` (a number that changes when the
corpus does, kept in checkpoints). One per source:
- `FileDocuments`: one document per file ("stdlib": the standard library's .py files).
- `SpanDocuments` ("text"): per file, or per non-blank line (`data.text_documents="line"`); a
  `.jsonl` file always holds one document per record, its `data.text_field` (or, with a masked
  `data.format`, the whole record rendered with its loss mask: `jaxpar.data.formats`). Lines and records
  are indexed by byte offset when the source opens.
- `TokenDocuments` ("tokens"): a flat token file cut by the offsets sidecar `prepare_data.py`
  writes (`FILE.offsets.npy`), or after every `data.eos_id`.
- `TokenWindows` ("tokens" with neither): no document boundaries are known, so the file is cut
  into windows of seq_len + 1 tokens, each a document filling one row (the stream as before).
Text is tokenized by `data.tokenizer` (`jaxpar.data.tokenizer.document_encoder`: bytes when unset).

`IndexedStream` reads a collection in the order training or eval needs: training shuffles with
`train.seed` and reshuffles every epoch (a grain MapDataset: document i of the endless order is a
pure function of the seed), eval reads it once in order. Its state is one number, the index of
the next document. Documents of fewer than 2 tokens (no target) are skipped. A held-out share
(`eval.share`): a document is held out when a hash of its tokens falls below the share, the same
verdict wherever it appears; training streams skip held-out documents, the eval stream keeps only
them (`HoldOut`).
"""

from __future__ import annotations

import hashlib
import json
import os

import grain
import numpy as np

# Token files up to this many tokens are scanned for `data.eos_id` in one piece; larger ones in blocks.
EOS_SCAN_BLOCK = 1 << 24


class DataError(ValueError):
    """A corpus that cannot be read as documents; the message is one line naming the key or file."""


class FileDocuments:
    """One document per file: `root`/`rel_paths`, at most `limit` bytes in all (the last file cut)."""

    def __init__(self, root: str, rel_paths: list[str], encoder, limit: int | None = None):
        self.root, self.encoder = root, encoder
        sizes = [os.path.getsize(os.path.join(root, rel)) for rel in rel_paths]
        if limit is not None:
            kept, total = [], 0
            for size in sizes:
                if total >= limit:
                    break
                kept.append(min(size, limit - total))
                total += kept[-1]
            sizes = kept
        self.paths, self.sizes = rel_paths[: len(sizes)], sizes
        self.size = int(sum(sizes))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index) -> np.ndarray:
        index = int(index)
        with open(os.path.join(self.root, self.paths[index]), "rb") as f:
            return self.encoder.encode_document(f.read(self.sizes[index]))


LINE_SCAN_BLOCK = 1 << 26  # bytes of a text file scanned for line breaks at a time
_BLANK = np.array([9, 10, 11, 12, 13, 32], np.uint8)  # ASCII whitespace


def _line_spans(path: str) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) byte offsets of the non-blank lines of a file (end excludes the newline),
    scanned block by block from a memory map (a file larger than RAM is fine)."""
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    starts, ends, texts = [], [], []
    line_start, has_text = 0, False  # the line running into the next block
    for offset in range(0, size, LINE_SCAN_BLOCK):
        block = np.asarray(data[offset : offset + LINE_SCAN_BLOCK])
        breaks = np.flatnonzero(block == 10)
        text = np.concatenate([[0], np.cumsum(~np.isin(block, _BLANK), dtype=np.int64)])
        cuts = np.concatenate([[0], breaks + 1])  # each line's first byte in this block
        upto = np.concatenate([breaks, [len(block)]])  # ... and its end in this block
        with_text = text[upto] - text[cuts] > 0
        with_text[0] |= has_text
        starts.append(np.concatenate([[line_start], cuts[1:] + offset]))
        ends.append(upto + offset)
        texts.append(with_text)
        # The block's last line continues: drop it here, carry its start and whether it had text.
        line_start, has_text = int(starts[-1][-1]), bool(with_text[-1])
        starts[-1], ends[-1], texts[-1] = starts[-1][:-1], ends[-1][:-1], texts[-1][:-1]
    starts.append(np.array([line_start]))
    ends.append(np.array([size]))
    texts.append(np.array([has_text]))
    keep = np.concatenate(texts)
    return np.concatenate(starts)[keep].astype(np.int64), np.concatenate(ends)[keep].astype(np.int64)


class SpanDocuments:
    """Documents as byte spans of text files: whole files, lines, or JSON records (.jsonl), a
    record's `text_field` or, with a `record_format` (`jaxpar.data.formats`), the whole record."""

    def __init__(self, files: list[str], encoder, *, per_line: bool, text_field: str, name: str = "data.path",
                 record_format=None):
        self.files, self.encoder, self.text_field, self.name = files, encoder, text_field, name
        self.record_format = record_format
        file_ids, starts, ends = [], [], []
        for i, path in enumerate(files):
            if path.endswith(".jsonl") or per_line:
                s, e = _line_spans(path)
            elif os.path.getsize(path) > 0:
                s, e = np.zeros(1, np.int64), np.full(1, os.path.getsize(path), np.int64)
            else:
                continue
            file_ids.append(np.full(len(s), i, np.int32))
            starts.append(s)
            ends.append(e)
        self.file_ids = np.concatenate(file_ids) if file_ids else np.zeros(0, np.int32)
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        self.size = int(sum(os.path.getsize(f) for f in files))

    def __len__(self) -> int:
        return len(self.starts)

    def _read(self, index: int) -> tuple[str, bytes]:
        path = self.files[self.file_ids[index]]
        with open(path, "rb") as f:
            f.seek(int(self.starts[index]))
            return path, f.read(int(self.ends[index] - self.starts[index]))

    def _where(self, index: int) -> str:
        path = self.files[self.file_ids[index]]
        return f"{self.name}: {path} line {line_number(path, int(self.starts[index]))}"

    def text(self, index: int):
        path, data = self._read(index)
        if not path.endswith(".jsonl"):
            return data
        try:
            return record_text(data, self.text_field, "")
        except DataError as e:  # named only now: counting the line costs a read of the file up to it
            raise DataError(f"{self.name}: {path} line {line_number(path, int(self.starts[index]))}{e}") from None

    def __getitem__(self, index) -> np.ndarray:
        index = int(index)
        if self.record_format is None:
            return self.encoder.encode_document(self.text(index))
        _, data = self._read(index)
        try:
            record = parse_record(data, "")
        except DataError as e:
            raise DataError(f"{self._where(index)}{e}") from None
        return self.record_format.document(record, lambda: self._where(index))


def parse_record(line: bytes, where: str):
    """One JSON value from a line; DataError naming `where` if it is not UTF-8 or not JSON."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 (byte {e.start} of the line is {line[e.start:e.start + 1].hex()}); "
                        f"convert the file to UTF-8") from None
    try:
        record = json.loads(decoded)
    except (ValueError, RecursionError) as e:
        detail = f" ({e.msg}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise DataError(f"{where} is not a JSON record{detail}") from None
    return record


def record_text(line: bytes, field: str, where: str) -> str:
    """The `field` string of one JSON record; DataError naming `where` (followed by what is wrong)
    if the line is not UTF-8, not a JSON object, or has no text in `field`."""
    record = parse_record(line, where)
    if not isinstance(record, dict) or field not in record or record[field] is None:
        raise DataError(f"{where} has no {field!r} field; set data.text_field")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not text; set data.text_field")
    return text


def line_number(path: str, offset: int) -> int:
    """The 1-based line of `path` that byte `offset` lies on."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count + 1


def offsets_path(token_file: str) -> str:
    """Where `prepare_data.py` writes a token file's document offsets: int64 [documents + 1],
    offsets[i] .. offsets[i+1] the tokens of document i."""
    return token_file + ".offsets.npy"


def eos_offsets(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Document offsets of a token array whose documents each end with `eos_id`."""
    ends = [np.flatnonzero(np.asarray(tokens[s : s + EOS_SCAN_BLOCK]) == eos_id) + (s + 1)
            for s in range(0, len(tokens), EOS_SCAN_BLOCK)]
    ends = np.concatenate([[0], *ends]).astype(np.int64)
    return ends if ends[-1] == len(tokens) else np.append(ends, len(tokens))


class TokenDocuments:
    """A memory-mapped token file cut into documents by `offsets` (int64 [documents + 1])."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self.tokens, self.offsets = tokens, offsets
        self.size = len(tokens)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index) -> np.ndarray:
        index = int(index)
        return np.asarray(self.tokens[int(self.offsets[index]) : int(self.offsets[index + 1])], dtype=np.int32)


class TokenWindows:
    """A token file without document boundaries as windows of `width` tokens (a trailing partial
    window dropped), each one document."""

    def __init__(self, tokens: np.ndarray, width: int):
        self.tokens, self.width = tokens, width
        self.size = len(tokens)

    def __len__(self) -> int:
        return len(self.tokens) // self.width

    def __getitem__(self, index) -> np.ndarray:
        start = int(index) * self.width
        return np.asarray(self.tokens[start : start + self.width], dtype=np.int32)


def held_out(tokens: np.ndarray, share: float) -> bool:
    """Whether a document belongs to the held-out share: a hash of its token ids below `share`."""
    digest = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < share * 2.0**64


class HoldOut:
    """Which documents a stream keeps: `eval=False` those outside the held-out share (training),
    `eval=True` those inside it (the eval set). share 0: every document is training's."""

    def __init__(self, share: float, eval: bool):
        self.share, self.eval = float(share), bool(eval)

    def __call__(self, tokens: np.ndarray) -> bool:
        if self.share <= 0:
            return not self.eval
        return held_out(tokens, self.share) == self.eval


class IndexedStream:
    """A collection's documents in training order (shuffled by `seed`, reshuffled each epoch,
    endless) or eval order (in order, once). State: {"index": documents read}."""

    def __init__(self, documents, *, seed: int, train: bool, keep=None, name: str = "data.path", channels: int = 2):
        self.documents, self.train, self.keep, self.name = documents, train, keep, name
        self.channels = channels  # of the batches packed from it (`jaxpar.data.packing`)
        dataset = grain.MapDataset.source(documents)
        self.dataset = dataset.shuffle(seed=seed).repeat() if train else dataset
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        misses = 0
        while True:
            if not self.train and self.index >= len(self.documents):
                raise StopIteration
            tokens = self.dataset[self.index]
            self.index += 1
            if len(tokens) >= 2 and (self.keep is None or self.keep(tokens)):
                return tokens
            misses += 1
            if misses > len(self.documents):  # a whole epoch without one usable document
                raise DataError(f"{self.name} holds no document of 2 or more tokens that training may read")

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])
