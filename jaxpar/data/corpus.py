"""From `config.data` and `config.eval` to document streams.

Sources (`Source`): `config.data` itself, or one per `data.mixture` entry (its own path and
weight, the data settings for the rest, any of them overridable in a list-of-dicts mixture), and
the eval source (`eval.path`, read with the data settings). Each opens as a collection of
documents (`jaxpar.data.documents`) or, for "datasets", a `datasets` stream
(`jaxpar.data.hf_stream`), and is read in training order (shuffled by the seed, endless) or eval
order (in order, once). `training_stream` mixes the training sources (`jaxpar.data.mixture`), with
weights that may change by step (`data.mixture_stages`, read by `mixture_stages`), leaving out the
held-out share (`eval.share`); `eval_stream` is `eval.path` or that share.

The checks of what these read, before a run starts, are `jaxpar.data.checks`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping

import numpy as np
from ml_collections import ConfigDict

from jaxpar.data import hf_stream
from jaxpar.data.documents import (
    DataError,
    FileDocuments,
    HoldOut,
    IndexedStream,
    SpanDocuments,
    TokenDocuments,
    TokenWindows,
    eos_offsets,
    offsets_path,
)
from jaxpar.data.formats import MASKED_FORMATS, record_format
from jaxpar.data.mixture import ChainStream, MixtureStream
from jaxpar.data.packing import MASKED_CHANNELS, TEXT_CHANNELS, Packer
from jaxpar.data.prepare import sidecar_path
from jaxpar.data.sources import corpus_fingerprint as source_fingerprint
from jaxpar.data.sources import corpus_warnings as source_warnings
from jaxpar.data.sources import load_tokens, source_tokens, stdlib_files, text_files
from jaxpar.data.tokenizer import document_encoder

TEXT_DOCUMENTS = ("file", "line")
# What a list-of-dicts mixture entry may set besides path, weight and name (what stages call it).
ENTRY_KEYS = ("source", "format", "text_field", "text_documents", "token_dtype", "eos_id")
STAGE_EXAMPLE = "[[1000, [1, 3]], [5000, [0, 1]]]"


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of documents: the data settings with this source's path (and weight)."""

    source: str
    path: str
    key: str  # the config key of `path`, for messages: data.path, data.mixture[1].path, eval.path
    token_dtype: str = "uint16"
    max_corpus_bytes: int = 0
    tokenizer: str = ""
    text_field: str = "text"
    text_documents: str = "file"
    eos_id: int = -1
    weight: float = 1.0
    format: str = "text"  # what a record holds (`jaxpar.data.formats`)


def _settings(data) -> dict:
    return {k: data[k] for k in ("source", "token_dtype", "max_corpus_bytes", "tokenizer", "text_field",
                                 "text_documents", "eos_id", "format")}


def mixture_entries(value) -> tuple[list[dict], list[str]]:
    """(entries, problems) of `data.mixture`: "" or an empty list → no mixture."""
    if value in (None, "") or (isinstance(value, (list, tuple)) and not value):
        return [], []
    if isinstance(value, str):
        entries, problems = [], []
        for i, part in enumerate(p for p in value.split(",") if p.strip()):
            path, sep, weight = part.strip().rpartition(":")
            try:
                entries.append({"path": path, "weight": float(weight)})
                if not sep or not path:
                    raise ValueError
            except ValueError:
                problems.append(f"data.mixture entry {i} {part.strip()!r} is not PATH:WEIGHT; write data.mixture="
                                f"'PATH:WEIGHT,PATH:WEIGHT'")
        return entries, problems
    if not isinstance(value, (list, tuple)):
        return [], [f"data.mixture={value!r} must be 'PATH:WEIGHT,...' or a list of dicts with path and weight"]
    entries, problems, names = [], [], {}
    for i, entry in enumerate(value):
        entry = dict(entry) if isinstance(entry, (Mapping, ConfigDict)) else entry
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            problems.append(f"data.mixture[{i}]={entry!r} must be a dict with path and weight")
            continue
        unknown = sorted(set(entry) - {"path", "weight", "name", *ENTRY_KEYS})
        if unknown:
            problems.append(f"data.mixture[{i}] has unknown key(s) {', '.join(unknown)}; known: path, weight, name, "
                            f"{', '.join(ENTRY_KEYS)}")
            continue
        name = entry.get("name")
        if "name" in entry and (not isinstance(name, str) or not name):
            problems.append(f"data.mixture[{i}].name={name!r} must be a non-empty string")
        elif name in names:
            problems.append(f"data.mixture[{i}].name={name!r} is also data.mixture[{names[name]}]'s; names are unique")
        elif name is not None:
            names[name] = i
        entries.append(entry)
    return entries, problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stage_weights(i: int, weights, entries: list[dict]) -> tuple[list[float] | None, list[str]]:
    """One stage's weights, one per entry in order: from a list by position or a dict by entry name."""
    key = f"data.mixture_stages[{i}]"
    if isinstance(weights, (Mapping, ConfigDict)):
        names = [e.get("name") for e in entries]
        unknown = [k for k in dict(weights) if k not in names]
        if unknown:
            known = ", ".join(repr(n) for n in names if n) or "none: name them with the key name in a list-of-dicts data.mixture"
            return None, [f"{key} weighs {unknown[0]!r}, which names no data.mixture entry (names: {known})"]
        if missing := [n for n in names if n not in weights]:
            label = repr(missing[0]) if missing[0] else f"data.mixture[{names.index(missing[0])}] (unnamed)"
            return None, [f"{key} leaves out {label}; give every entry a weight (0 leaves it out of the stage)"]
        weights = [weights[n] for n in names]
    elif not isinstance(weights, (list, tuple)):
        return None, [f"{key}'s weights {weights!r} must be a list, one per data.mixture entry, or a dict by entry name"]
    if len(weights) != len(entries):
        return None, [f"{key} gives {len(weights)} weights for data.mixture's {len(entries)} entries; give one per entry"]
    for j, w in enumerate(weights):
        if not (_is_number(w) and math.isfinite(w) and w >= 0):
            return None, [f"{key}: the weight {w!r} of data.mixture[{j}] must be a finite number >= 0"]
    if not sum(weights) > 0:
        return None, [f"{key} weighs every data.mixture entry 0; give one a weight > 0"]
    return [float(w) for w in weights], []


def mixture_stages(data) -> tuple[list[tuple[int, list[float]]], list[str]]:
    """(stages, problems) of `data.mixture_stages`: [[STEP, WEIGHTS], ...], from train step STEP on
    (steps count from 1) documents are drawn with WEIGHTS, a list with one weight per `data.mixture`
    entry or a dict by entry name; data.mixture's own weights hold before the first stage."""
    value = data.mixture_stages
    if value in (None, "") or (isinstance(value, (list, tuple)) and not value):
        return [], []
    if not isinstance(value, (list, tuple)):
        return [], [f"data.mixture_stages={value!r} must be a list of [STEP, WEIGHTS], e.g. {STAGE_EXAMPLE}"]
    entries, problems = mixture_entries(data.mixture)
    if problems:
        return [], []  # named by data.mixture's own check
    if not entries:
        return [], ["data.mixture_stages is set but data.mixture is not; stages change the weights of a mixture's entries"]
    stages, last = [], 1
    for i, stage in enumerate(value):  # the first problem only: later stages are measured against it
        if not isinstance(stage, (list, tuple)) or len(stage) != 2:
            return [], [f"data.mixture_stages[{i}]={stage!r} must be [STEP, WEIGHTS], e.g. {STAGE_EXAMPLE}"]
        step, weights = stage
        if not (isinstance(step, int) and not isinstance(step, bool)) or step <= last:
            where = ("data.mixture's own weights hold from step 1 (give them the first weights)" if last == 1
                     else f"the stage before starts at step {last}")
            return [], [f"data.mixture_stages[{i}] starts at step {step!r}; {where}, so give an integer step > {last}"]
        weights, problems = _stage_weights(i, weights, entries)
        if problems:
            return [], problems
        stages.append((step, weights))
        last = step
    return stages, []


def training_sources(data) -> list[Source]:
    """The data section (`config.data`) as one source, or one per mixture entry (assumes valid settings)."""
    entries, _ = mixture_entries(data.mixture)
    if not entries:
        return [Source(path=str(data.path), key="data.path", **_settings(data))]
    return [
        Source(**{**_settings(data), **{k: e[k] for k in ENTRY_KEYS if k in e}}, path=str(e["path"]),
               key=f"data.mixture[{i}].path", weight=float(e["weight"]))
        for i, e in enumerate(entries)
    ]


def eval_source(config) -> Source | None:
    """`eval.path` read with the data settings, or None (no eval path)."""
    if not config.eval.path:
        return None
    return Source(path=str(config.eval.path), key="eval.path", **_settings(config.data))


def eval_enabled(config) -> bool:
    return bool(config.eval.path) or config.eval.share > 0


@functools.lru_cache(maxsize=8)
def _encoder(path: str):
    return document_encoder(path)


def encoder_of(src: Source):
    return _encoder(src.tokenizer)


def _token_offsets(src: Source, tokens: np.ndarray) -> np.ndarray | None:
    side = offsets_path(src.path)
    if os.path.isfile(side):
        return np.load(side, mmap_mode="r")
    return eos_offsets(tokens, src.eos_id) if src.eos_id >= 0 else None


def format_of(src: Source, seq_len: int):
    """The source's record format (`jaxpar.data.formats`), None for plain text."""
    return record_format(src.format, encoder_of(src), seq_len + 1, src.key)


def batch_channels(config) -> int:
    """Channels of the run's batches [G, channels, S+1]: 3 (a loss mask) when a training or eval
    source has a masked `data.format`, else 2 (`jaxpar.data.packing`)."""
    sources = training_sources(config.data) + [s for s in [eval_source(config)] if s is not None]
    return MASKED_CHANNELS if any(s.format in MASKED_FORMATS for s in sources) else TEXT_CHANNELS


def open_collection(src: Source, seq_len: int):
    """The source's documents as a random-access collection (not for "datasets")."""
    if src.source == "stdlib":
        root, rel_paths = stdlib_files()
        return FileDocuments(root, rel_paths, encoder_of(src), limit=int(src.max_corpus_bytes))
    if src.source == "text":
        return SpanDocuments(text_files(src.path), encoder_of(src), per_line=src.text_documents == "line",
                             text_field=src.text_field, name=src.key, record_format=format_of(src, seq_len))
    tokens = np.memmap(src.path, dtype=np.dtype(src.token_dtype), mode="r")
    offsets = _token_offsets(src, tokens)
    return TokenWindows(tokens, seq_len + 1) if offsets is None else TokenDocuments(tokens, offsets)


def open_stream(src: Source, seq_len: int, seed: int, *, train: bool, keep=None, channels: int = TEXT_CHANNELS):
    """The source's documents in training or eval order, for batches of `channels` (`batch_channels`)."""
    if src.source == "datasets":
        return hf_stream.DatasetStream(hf_stream.dataset_files(src.path, src.key), encoder_of(src),
                                       text_field=src.text_field, seed=seed, train=train, keep=keep, name=src.key,
                                       record_format=format_of(src, seq_len), channels=channels)
    return IndexedStream(open_collection(src, seq_len), seed=seed, train=train, keep=keep, name=src.key, channels=channels)


def training_stream(config):
    """The training documents: endless, shuffled by `train.seed`, without the held-out share."""
    seq_len, seed = config.train.seq_len, config.train.seed
    keep = HoldOut(config.eval.share, eval=False) if config.eval.share > 0 else None
    sources, channels = training_sources(config.data), batch_channels(config)
    streams = [open_stream(src, seq_len, seed, train=True, keep=keep, channels=channels) for src in sources]
    if len(streams) == 1:
        return streams[0]
    return MixtureStream(streams, [src.weight for src in sources], seed, stages=mixture_stages(config.data)[0])


def eval_stream(config):
    """The eval documents, in a fixed order, once: `eval.path`, or the held-out share of every
    training source (in source order). None without eval."""
    seq_len, seed = config.train.seq_len, config.train.seed
    src, channels = eval_source(config), batch_channels(config)
    if src is not None:
        return open_stream(src, seq_len, seed, train=False, channels=channels)
    if config.eval.share <= 0:
        return None
    keep = HoldOut(config.eval.share, eval=True)
    streams = [open_stream(s, seq_len, seed, train=False, keep=keep, channels=channels) for s in training_sources(config.data)]
    return streams[0] if len(streams) == 1 else ChainStream(streams)


def eval_batches(config) -> Packer | None:
    """A fresh iterator over the eval set's global batches (the last one padded), packed as
    training packs; None without eval."""
    stream = eval_stream(config)
    if stream is None:
        return None
    train = config.train
    return Packer(stream, train.global_batch_size, train.seq_len + 1, bool(config.data.packing), batch_channels(config))


def corpus_tokens(data) -> int:
    """The training corpus's size (`source_tokens`, summed over a mixture) from the data section:
    checkpoints keep it, and a resumed run refuses a corpus that changed."""
    return sum(source_tokens(src) for src in training_sources(data))


def corpus_fingerprint(data) -> str:
    """A hash of every training source's size and content (`jaxpar.data.sources.corpus_fingerprint`)."""
    parts = [source_fingerprint(src) for src in training_sources(data)]
    return parts[0] if len(parts) == 1 else hashlib.blake2b("".join(parts).encode(), digest_size=16).hexdigest()


def corpus_warnings(data) -> list[str]:
    """What the training sources' preflight accepts but looks wrong (`jaxpar.data.sources.corpus_warnings`)."""
    warnings = []
    for src in training_sources(data):
        if src.source == "tokens":
            warnings += source_warnings(src, np.memmap(src.path, dtype=np.dtype(src.token_dtype), mode="r"))
        elif src.source == "text" and not src.tokenizer:
            warnings += source_warnings(src, load_tokens(src))
    return [w.replace("data.path=", f"{src.key}=") if src.key != "data.path" else w for w in warnings]


def _tokenizer_of(src: Source) -> str:
    """What turned the source's text into ids: data.tokenizer, bytes, or for a token file the
    tokenizer its sidecar names (prepare_data.py records it)."""
    if src.source != "tokens":
        return f"tokenizer {src.tokenizer}" if src.tokenizer else "bytes as tokens"
    side = sidecar_path(src.path)
    try:
        with open(side) as f:
            return f"tokenizer {json.load(f)['tokenizer']}, named by {os.path.basename(side)}"
    except (OSError, ValueError, KeyError, TypeError):
        return "ids of a tokenizer no sidecar names"


def describe(config) -> str:
    """What the run reads, for the start-up log: one line, or a mixture's sources one per line with
    their weights and the share of documents each is drawn for."""
    sources = training_sources(config.data)
    packing = "packed" if config.data.packing else "one document per row"
    masked = sorted({s.format for s in sources if s.format in MASKED_FORMATS})
    packing += "".join(f", {f} records (loss on the {'assistant' if f == 'chat' else 'completion'} tokens)" for f in masked)
    tokenizers = ", ".join(dict.fromkeys(_tokenizer_of(s) for s in sources))
    where = {s.key: "the Python standard library's source" if s.source == "stdlib" else f"{s.source} {s.path}"
             for s in sources}
    if len(sources) == 1:
        return f"data: {where[sources[0].key]} ({packing}; {tokenizers})"
    total = sum(s.weight for s in sources)
    lines = [f"data: a mixture of {len(sources)} sources, drawn document by document ({packing}; {tokenizers}):"]
    lines += [f"  {where[s.key]}: weight {s.weight:g} ({s.weight / total:.0%} of documents)" for s in sources]
    for step, weights in mixture_stages(config.data)[0]:
        shares = ", ".join(f"{w:g} ({w / sum(weights):.0%})" for w in weights)
        lines.append(f"  from step {step}, weights {shares}")
    return "\n".join(lines)


__all__ = ["DataError", "Source", "batch_channels", "corpus_fingerprint", "corpus_tokens", "corpus_warnings", "eval_batches", "eval_stream",
           "training_stream"]
