"""The "datasets" source: local jsonl / json / parquet / arrow files streamed by Hugging Face `datasets`.

`data.path` is a file, a folder (every file below it with a known extension) or a glob
(`**` recursive). The files are read with `datasets.load_dataset(builder, data_files=...,
streaming=True)`: records are read a batch at a time, never the whole corpus, so a corpus larger
than RAM works and nothing is written (no Arrow cache). Each record's `data.text_field` is one
document, tokenized by `data.tokenizer` (`jaxpar.data.tokenizer.document_encoder`).

Order: training reads the files in an order shuffled by (`train.seed`, epoch) — documents within
a file stay in file order (shuffle the records of large shards beforehand; for a corpus shuffled
document by document use `prepare_data.py` and the "tokens" source) — and starts over with the
next epoch's order at the end; eval reads the files once in sorted order. The state is the epoch,
`datasets`' own stream position (`IterableDataset.state_dict`, exact at every record) and the
records read, so a resumed run reads on from the very next record.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from jaxpar.data.documents import DataError
from jaxpar.extras import MissingExtra, require

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def dataset_files(path: str, key: str = "data.path") -> list[str]:
    """The files `path` names (file, folder or glob), sorted; DataError if none has a known format
    or they mix formats."""
    if os.path.isdir(path):
        found = [os.path.join(d, n) for d, dirs, names in os.walk(path) for n in names if not n.startswith(".")]
        found = [f for f in found if os.path.splitext(f)[1] in FORMATS]
    elif os.path.isfile(path):
        found = [path]
    else:
        found = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    if not found:
        raise DataError(f"{key}={path!r} matches no file; give a file, a folder or a glob of {'/'.join(FORMATS)} files")
    unknown = sorted({os.path.splitext(f)[1] or "(no extension)" for f in found} - set(FORMATS))
    if unknown:
        raise DataError(f"{key}={path!r} matches files of unknown format {', '.join(unknown)}; use {'/'.join(FORMATS)} files")
    builders = {FORMATS[os.path.splitext(f)[1]] for f in found}
    if len(builders) > 1:
        raise DataError(
            f"{key}={path!r} mixes {' and '.join(sorted(builders))} files; use one format per source (data.mixture "
            f"can combine sources)"
        )
    return sorted(found)


def builder_of(files: list[str]) -> str:
    return FORMATS[os.path.splitext(files[0])[1]]


def open_stream(files: list[str], *, order: list[str] | None = None, needed_by: str = "data.source='datasets'",
                key: str = "data.path"):
    """A `datasets` IterableDataset over `files` (in `order`, default sorted); DataError (one line
    naming `needed_by` and the extra to install) without `datasets`."""
    # Imported here: `datasets` takes seconds to import and only this source needs it.
    try:
        datasets = require("datasets", needed_by)
    except MissingExtra as e:
        raise DataError(str(e)) from None
    datasets.disable_progress_bars()
    # Its "Failed to load JSON from file ..." error lines: jaxpar reports such a failure itself, in one line.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(builder_of(files), data_files=list(order or files), split="train", streaming=True)
    except Exception as e:  # noqa: BLE001 - `datasets` infers the schema from the first file: an empty or unreadable one
        raise DataError(f"{key}: {_named(order or files)} cannot be read ({_reason(e)})") from None


def _named(files: list[str]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more files" if len(files) > 3 else "")


def _reason(error: BaseException) -> str:
    """`datasets` / pyarrow's error in a few words: an empty file ends its schema inference in a bare StopIteration."""
    if isinstance(error, StopIteration):
        return "no record"
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def first_record(path: str):
    """The first record of one file (or None if it has none)."""
    for record in open_stream([path]):
        return record
    return None


def _current_file(state, files: list[str]) -> str | None:
    """The file a `datasets` stream is in, from its state_dict's innermost `shard_idx` (None if this
    version of `datasets` does not say)."""
    while isinstance(state, dict) and isinstance(state.get("examples_iterable"), dict):
        state = state["examples_iterable"]
    index = state.get("shard_idx") if isinstance(state, dict) else None
    return files[index] if isinstance(index, int) and 0 <= index < len(files) else None


class DatasetStream:
    """Documents of `files`, one per record's `text_field`, in training or eval order (module
    docstring). `keep`: the held-out filter (`jaxpar.data.documents.HoldOut`) or None."""

    def __init__(self, files: list[str], encoder, *, text_field: str, seed: int, train: bool, keep=None,
                 name: str = "data.path", record_format=None, channels: int = 2):
        self.files, self.encoder, self.text_field = list(files), encoder, text_field
        self.record_format, self.channels = record_format, channels  # `jaxpar.data.formats`, `jaxpar.data.packing`
        self.seed, self.train, self.keep, self.name = seed, train, keep, name
        self.found, self.dry_ends = 0, 0  # usable documents since the last epoch end; dry epoch ends in a row
        self._open(0, None, 0)

    def _order(self, epoch: int) -> list[str]:
        if not self.train:
            return self.files
        rng = np.random.default_rng([self.seed, epoch])
        return [self.files[i] for i in rng.permutation(len(self.files))]

    def _open(self, epoch: int, position: dict | None, records: int) -> None:
        self.epoch, self.records = epoch, records
        self.dataset = open_stream(self.files, order=self._order(epoch), key=self.name)
        if position is not None:
            self.dataset.load_state_dict(position)
        self.iterator = iter(self.dataset)

    def __iter__(self):
        return self

    def _unreadable(self, error: BaseException) -> DataError:
        where = _current_file(self.dataset.state_dict(), self._order(self.epoch))
        return DataError(f"{self.name}: {where or _named(self.files)} cannot be read after record {self.records} of epoch "
                         f"{self.epoch} ({_reason(error)})")

    def __next__(self) -> np.ndarray:
        while True:
            try:
                record = next(self.iterator)
            except DataError:
                raise
            except StopIteration:
                if not self.train:
                    raise
                # Two epoch ends in a row with no usable document between them: there is none.
                self.dry_ends = 0 if self.found else self.dry_ends + 1
                if self.dry_ends > 1:
                    raise DataError(f"{self.name} holds no document of 2 or more tokens that training may read") from None
                self.found = 0
                self._open(self.epoch + 1, None, 0)
                continue
            except Exception as e:  # noqa: BLE001 - pyarrow / `datasets` failing on a file: one line naming it
                raise self._unreadable(e) from None
            self.records += 1
            if self.record_format is not None:
                tokens = self.record_format.document(record, self._where)
                if len(tokens) >= 2 and (self.keep is None or self.keep(tokens)):
                    self.found += 1
                    return tokens
                continue
            text = record.get(self.text_field)
            if not isinstance(text, str):
                what = f"has no {self.text_field!r} field" if text is None else \
                    f"holds a {type(text).__name__} in field {self.text_field!r}, not text"
                raise DataError(f"{self._where()} {what}; set data.text_field")
            tokens = self.encoder.encode_document(text)
            if len(tokens) >= 2 and (self.keep is None or self.keep(tokens)):
                self.found += 1
                return tokens

    def _where(self) -> str:
        """The record just read: its number and epoch (and file, where `datasets` says)."""
        where = _current_file(self.dataset.state_dict(), self._order(self.epoch))
        return f"{self.name}: record {self.records} of epoch {self.epoch}" + (f" (in {where})" if where else "")

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "records": self.records, "position": self.dataset.state_dict()}

    def set_state(self, state: dict) -> None:
        self._open(int(state["epoch"]), state["position"], int(state["records"]))
