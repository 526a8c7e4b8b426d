"""Packing documents into global batches [G, 2, S+1]: tokens and segment ids, in text order.

Each row holds S+1 tokens (inputs and, shifted by one, targets) and, beside them, the segment id
of every token: 1, 2, 3, ... for the documents in the row in order, 0 for padding. A target
counts only where the input's segment continues (`jaxpar.parallel.context.sequence`), so no
target crosses a document boundary and padding is never one; positions restart at 0 at each
segment's first token (the train step derives them from the segment ids).

`data.packing=True`: first fit over the batch's G rows, in stream order. A document that fits
some row goes into the first row with room for it, whole: documents of at most S+1 tokens are
never split. A longer one fills empty rows S+1 tokens at a time, each piece starting with the
previous piece's last token (it was that piece's last target and is this one's first input, so
every target of the document is trained once); each piece is its own segment, its positions
restarting at 0 (it cannot see the previous piece, which sits in another row). The batch is done
at the first document (or piece) that fits no row: it waits for the next batch.
`data.packing=False`: one document per row, cut to S+1 tokens, padded.

State: where the next batch starts — the stream's state before the waiting document and how far
into it (a long document's next piece) — and how many batches were packed, so a resumed run packs
exactly the batches it would have. Documents of fewer than 2 tokens (no target) never reach the packer.

Loss masks (`data.format` chat or prompt_completion, `jaxpar.data.formats`): the batch has a third
channel [G, 3, S+1], 1 where the token is a target the loss counts (the assistant's tokens, a
completion's), 0 elsewhere and in padding; a masked document reaches the packer as [n, 2] (its ids
and its mask), a plain one (1-D) counts every token. The channel count is the stream's (`channels`,
2 when it holds only plain text: those batches are exactly as before). Masked documents are never
longer than a row (`jaxpar.data.formats` cuts them at a turn), so none is ever split. A preference
pair arrives as [n, 3] (ids, mask, part): each part becomes its own segment of the same row (part p
of a pair starting at segment s is segment s + p), so chosen and rejected never attend to each other.

A stream whose draws depend on the step (`StepStream`: a mixture whose weights change by stage) is
told which batch is packed next; where its draws change, a whole document drawn for the batch before
that waits (it did not fit) goes back and is drawn again, so every document that starts in a batch
was drawn with that batch's weights.
"""

from __future__ import annotations

import numpy as np

TOKENS, SEGMENTS, LOSS_MASK = 0, 1, 2  # the channels of a packed batch (the third only with loss masks)
TEXT_CHANNELS, MASKED_CHANNELS = 2, 3


class StepStream:
    """A document stream whose draws depend on the batch being packed (`jaxpar.data.mixture`)."""

    def begin_batch(self, index: int) -> bool:
        """Draw for batch `index` (from 0) from now on; True where the draws differ from the previous batch's."""
        raise NotImplementedError


class Packer:
    """Global batches [rows, channels, width] from a document stream (`__next__`, `get_state`,
    `set_state`); `channels` defaults to the stream's own (2 for a stream that does not say)."""

    def __init__(self, stream, rows: int, width: int, packing: bool = True, channels: int | None = None):
        if rows < 1 or width < 2:
            raise ValueError(f"packing needs rows >= 1 and width >= 2, got {rows} and {width}")
        self.stream, self.rows, self.width, self.packing = stream, int(rows), int(width), bool(packing)
        self.channels = int(getattr(stream, "channels", TEXT_CHANNELS) if channels is None else channels)
        self.waiting = None  # (tokens, offset, stream state before reading them)
        self.batches = 0  # batches packed: the index of the next one

    def _take(self):
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            return waiting
        before = self.stream.get_state()
        return next(self.stream), 0, before

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        """The next batch; StopIteration once the stream is done and nothing waits (a last batch
        with rows left over is padded)."""
        self._begin_batch()
        batch = self._pack()
        self.batches += 1
        return batch

    def _begin_batch(self) -> None:
        if not isinstance(self.stream, StepStream) or not self.stream.begin_batch(self.batches):
            return
        if self.waiting is not None and self.waiting[1] == 0:  # a whole document, drawn with the old weights
            before, self.waiting = self.waiting[2], None
            self.stream.set_state(before)
            self.stream.begin_batch(self.batches)

    def _pack(self) -> np.ndarray:
        batch = np.zeros((self.rows, self.channels, self.width), np.int32)
        filled = np.zeros(self.rows, np.int64)  # tokens in each row
        segments = np.zeros(self.rows, np.int32)  # documents (pieces) in each row
        while True:
            try:
                tokens, offset, before = self._take()
            except StopIteration:
                if not filled.any():
                    raise
                return batch
            piece = tokens[offset:]
            if not self.packing:
                row = int(np.argmin(filled > 0))  # the first empty row
                if filled[row]:
                    self.waiting = (tokens, offset, before)
                    return batch
                piece = piece[: self.width]
            elif len(piece) <= self.width:
                fits = np.flatnonzero(self.width - filled >= len(piece))
                if not len(fits):
                    self.waiting = (tokens, offset, before)
                    return batch
                row = int(fits[0])
            else:  # longer than a row: a full piece into the first empty row, the rest waits
                empty = np.flatnonzero(filled == 0)
                if not len(empty):
                    self.waiting = (tokens, offset, before)
                    return batch
                row, piece = int(empty[0]), piece[: self.width]
                if len(tokens) - (offset + self.width - 1) >= 2:  # the next piece has a target
                    self.waiting = (tokens, offset + self.width - 1, before)
            start = int(filled[row])
            segments[row] += 1
            ids, mask = (piece[:, 0], piece[:, 1]) if piece.ndim == 2 else (piece, 1)
            part = piece[:, 2] if piece.ndim == 2 and piece.shape[1] > 2 else np.zeros(1, np.int32)
            batch[row, TOKENS, start : start + len(piece)] = ids
            batch[row, SEGMENTS, start : start + len(piece)] = segments[row] + part
            segments[row] += int(part.max())
            if self.channels > LOSS_MASK:
                batch[row, LOSS_MASK, start : start + len(piece)] = mask
            filled[row] += len(piece)

    def get_state(self) -> dict:
        if self.waiting is None:
            return {"stream": self.stream.get_state(), "offset": None, "batches": self.batches}
        tokens, offset, before = self.waiting
        return {"stream": before, "offset": offset, "batches": self.batches}

    def set_state(self, state: dict) -> None:
        self.stream.set_state(state["stream"])
        self.waiting, self.batches = None, int(state.get("batches", 0))  # 0: a checkpoint from before the count
        if state["offset"] is not None:
            before = self.stream.get_state()
            self.waiting = (next(self.stream), int(state["offset"]), before)


class ListStream:
    """Documents from a list, in order, once: the stream protocol the packer reads (`__next__`,
    `get_state`, `set_state`), for documents already in memory (benchmarks, tests)."""

    def __init__(self, docs):
        self.docs, self.index = [np.asarray(d, np.int32) for d in docs], 0
        self.channels = MASKED_CHANNELS if any(d.ndim == 2 for d in self.docs) else TEXT_CHANNELS

    def __iter__(self):
        return self

    def __next__(self):
        if self.index >= len(self.docs):
            raise StopIteration
        self.index += 1
        return self.docs[self.index - 1]

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]
