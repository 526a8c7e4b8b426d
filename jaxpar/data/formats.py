"""`data.format`: what a record of a record file (.jsonl for the text source; any file of the
datasets source) holds, and which of its tokens the loss counts.

- "text": the record's `data.text_field` is a document; every token counts (as always).
- "chat": `{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`, rendered
  by `data.tokenizer`'s chat template; only the assistant's tokens count, in every turn
  (`jaxpar.data.chat.render_conversation`).
- "prompt_completion": `{"prompt": ..., "completion": ...}`, both text or both lists of messages;
  only the completion's tokens (its EOS included) count (`jaxpar.data.chat.render_completion`).
- "preference": `{"prompt": ..., "chosen": ..., "rejected": ...}`, all text or all lists of messages:
  a pair for `train.objective="dpo"` (`jaxpar.train.dpo`), rendered as prompt + chosen and prompt +
  rejected, each like a prompt–completion record. The pair is ONE document [n, 3] (ids, loss mask,
  part): the packer keeps it whole in one row, each half its own segment (chosen s, rejected s + 1,
  so they never see each other and positions restart); the mask is 1 at the chosen completion's
  tokens, 2 at the rejected one's.

A masked record becomes a document [n, 2] (ids, loss mask) that the packer packs like any other,
in a batch with a third channel (`jaxpar.data.packing`). The format is per source: a mixture entry
may set its own `format`, so chat and plain text can be mixed (the text documents count every token).

Longer than a row (train.seq_len + 1 tokens), a masked record is never split across rows. It is
shortened at a turn boundary: the trailing turns that do not fit are dropped, keeping the longest
run of whole turns that ends with an assistant reply (`shortened`). If not even the first reply
ends within the row, the row is filled from the start and the reply cut at the row's end, as TRL
truncates to `max_length` (`cut`); if no assistant token fits at all (a prompt longer than a row),
the record is skipped (`skipped`). A preference pair longer than a row keeps both halves whole while
it can: only the longer half is cut at the row's end if the shorter fits in half a row, else each is
cut to half a row (`pair_cut`; the prompt's tokens stay, the completions lose their ends); a half
left without a completion token skips the pair (`pair_skipped`). Each happening is counted and logged (the 1st, 10th, 100th ... of
each per source and process, naming the file and line), never silent.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from jaxpar.data.chat import RecordError, Rendered, chat_tokenizer, render_completion, render_conversation
from jaxpar.data.documents import DataError

FORMATS = ("text", "chat", "prompt_completion", "preference")
MASKED_FORMATS = ("chat", "prompt_completion", "preference")
FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"), "preference": ("prompt", "chosen", "rejected")}
PAIR_HALVES = ("chosen", "rejected")  # their loss-mask marks are 1 and 2 (`jaxpar.train.dpo`)
OUTCOMES = {
    "shortened": "longer than a row: its trailing turns that do not fit are dropped",
    "cut": "longer than a row before its first reply ends: the reply is cut at the row's end",
    "skipped": "longer than a row before its first assistant token: skipped",
    "pair_cut": "a preference pair longer than a row: its completions are cut so both halves fit",
    "pair_skipped": "a preference pair whose prompt leaves a half no completion token in a row: skipped",
}
log = logging.getLogger(__name__)
# (source key, outcome) → records so far in this process: shared by every reader of a source (the
# preflight, training, each evaluation), so the 1st, 10th, 100th ... is logged once, not per reader.
SEEN = Counter()


def fit_row(rendered: Rendered, width: int) -> tuple[Rendered | None, str | None]:
    """(the record within `width` tokens or None if skipped, the outcome or None if it fit) by the
    policy of the module docstring."""
    if len(rendered.ids) <= width:
        return rendered, None
    ends = [e for e in rendered.turn_ends if e <= width]
    if ends:
        keep, outcome = ends[-1], "shortened"
    elif rendered.mask[1:width].any():  # a target inside the row (the first token is no target)
        keep, outcome = width, "cut"
    else:
        return None, "skipped"
    return Rendered(rendered.ids[:keep], rendered.mask[:keep], tuple(e for e in rendered.turn_ends if e <= keep)), outcome


def fit_pair(halves: tuple[Rendered, Rendered], width: int) -> tuple[tuple[Rendered, Rendered] | None, str | None]:
    """(a preference pair's halves within `width` tokens together or None if skipped, the outcome or
    None if it fit) by the policy of the module docstring."""
    lengths = [len(h.ids) for h in halves]
    if sum(lengths) <= width:
        return halves, None
    short = min(lengths)
    caps = (width - short,) * 2 if short <= width // 2 else (width // 2, width - width // 2)
    kept = []
    for half, cap in zip(halves, caps):
        n = min(len(half.ids), cap)
        if not half.mask[1:n].any():  # the first token is no target
            return None, "pair_skipped"
        kept.append(Rendered(half.ids[:n], half.mask[:n], (n,)))
    return tuple(kept), "pair_cut"


def pair_document(halves: tuple[Rendered, Rendered]) -> np.ndarray:
    """The packer's form of a preference pair: [n, 3] int32, ids, loss mask (1 chosen, 2 rejected)
    and part (0 chosen, 1 rejected: each part its own segment)."""
    chosen, rejected = halves
    ids = np.concatenate([chosen.ids, rejected.ids])
    mask = np.concatenate([chosen.mask, 2 * rejected.mask])
    part = np.concatenate([np.zeros(len(chosen.ids), np.int32), np.ones(len(rejected.ids), np.int32)])
    return np.stack([ids, mask, part], axis=1).astype(np.int32)


def masked_document(rendered: Rendered) -> np.ndarray:
    """The packer's form of a masked record: [n, 2] int32, ids and loss mask."""
    return np.stack([rendered.ids, rendered.mask], axis=1).astype(np.int32)


class RecordFormat:
    """A masked `data.format` of one source: a record (a dict) to a document within `width` tokens."""

    def __init__(self, name: str, encoder, width: int, key: str):
        if name not in MASKED_FORMATS:
            raise ValueError(f"RecordFormat is for {MASKED_FORMATS}, got {name!r}")
        self.name, self.encoder, self.width, self.key = name, encoder, int(width), key
        self.counts = Counter()

    def render(self, record) -> Rendered | tuple[Rendered, Rendered]:
        """The record's ids and loss mask, whole (a preference pair: its two halves); RecordError if it is
        not a record of this format."""
        if not isinstance(record, dict):
            raise RecordError(f"is not a JSON object with {' and '.join(repr(f) for f in FIELDS[self.name])}")
        missing = [f for f in FIELDS[self.name] if record.get(f) is None]
        if missing:
            raise RecordError(f"has no {missing[0]!r} field (data.format={self.name!r} reads "
                              f"{' and '.join(repr(f) for f in FIELDS[self.name])})")
        if self.name == "chat":
            return render_conversation(chat_tokenizer(self.encoder), record["messages"])
        if self.name == "preference":
            return tuple(self._half(record["prompt"], record[half], half) for half in PAIR_HALVES)
        return render_completion(self.encoder, record["prompt"], record["completion"])

    def _half(self, prompt, completion, name: str) -> Rendered:
        try:
            return render_completion(self.encoder, prompt, completion)
        except RecordError as e:
            raise RecordError(f"its {name!r} half: {str(e).replace('completion', name)}") from None

    def document(self, record, where) -> np.ndarray:
        """The record as a document [n, 2] (empty if skipped); DataError naming `where()` (the file
        and line, computed only when needed) if it cannot be rendered."""
        try:
            rendered = self.render(record)
        except RecordError as e:
            text = str(e)
            raise DataError(f"{where()} {text}" if text.startswith(("is ", "has ")) else f"{where()}: {text}") from None
        pair = self.name == "preference"
        fitted, outcome = (fit_pair if pair else fit_row)(rendered, self.width)
        if outcome is not None:
            self.counts[outcome] += 1
            SEEN[self.key, outcome] += 1
            count = SEEN[self.key, outcome]
            if count == 10 ** (len(str(count)) - 1):  # 1, 10, 100, ...
                size = sum(len(h.ids) for h in rendered) if pair else len(rendered.ids)
                log.warning("%s: a record of %d tokens is %s (train.seq_len+1=%d; %d record(s) so far)",
                            where(), size, OUTCOMES[outcome], self.width, count)
        if fitted is None:
            return np.zeros((0, 3 if pair else 2), np.int32)
        return pair_document(fitted) if pair else masked_document(fitted)


def record_format(name: str, encoder, width: int, key: str) -> RecordFormat | None:
    """The source's record format, None for plain text."""
    return None if name == "text" else RecordFormat(name, encoder, width, key)


__all__ = ["FORMATS", "MASKED_FORMATS", "OUTCOMES", "RecordFormat", "fit_pair", "fit_row", "masked_document", "pair_document",
           "record_format"]
