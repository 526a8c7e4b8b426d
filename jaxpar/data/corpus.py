"""From `config.data` and `config.eval` to document streams, and their checks.

Sources (`Source`): `config.data` itself, or one per `data.mixture` entry (its own path and
weight, the data settings for the rest, any of them overridable in a list-of-dicts mixture), and
the eval source (`eval.path`, read with the data settings). Each opens as a collection of
documents (`jaxpar.data.documents`) or, for "datasets", a `datasets` stream
(`jaxpar.data.hf_stream`), and is read in training order (shuffled by the seed, endless) or eval
order (in order, once). `training_stream` mixes the training sources (`jaxpar.data.mixture`),
leaving out the held-out share (`eval.share`); `eval_stream` is `eval.path` or that share.

Checks: `validate_data_config` — the settings alone (paths stat-ed, nothing read);
`corpus_problems` — the preflight that opens every source: token files' sidecars, offsets and id
ranges, the tokenizer and its vocabulary against `model.vocab_size`, every record file's text
field, enough tokens for one global batch (where the size is known without tokenizing), a first
usable document for training, and an eval set long enough for `eval.steps`. One line per problem,
each naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
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
    record_text,
)
from jaxpar.data.mixture import ChainStream, MixtureStream
from jaxpar.data.packing import Packer
from jaxpar.data.prepare import sidecar_path, token_file_problems
from jaxpar.data.sources import (
    SOURCES,
    TEXT_SOURCES,
    TOKEN_DTYPES,
    load_tokens,
    source_problems,
    source_tokens,
    stdlib_files,
    text_files,
    token_range_problems,
)
from jaxpar.data.sources import corpus_fingerprint as source_fingerprint
from jaxpar.data.sources import corpus_warnings as source_warnings
from jaxpar.data.tokenizer import ByteTokenizer, TokenizerError, document_encoder, vocab_size_fix
from jaxpar.extras import installed, missing_line
from jaxpar.ranges import at_least, one_of, within

TEXT_DOCUMENTS = ("file", "line")
# What a list-of-dicts mixture entry may set besides path and weight.
ENTRY_KEYS = ("source", "text_field", "text_documents", "token_dtype", "eos_id")


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


def _settings(data) -> dict:
    return {k: data[k] for k in ("source", "token_dtype", "max_corpus_bytes", "tokenizer", "text_field",
                                 "text_documents", "eos_id")}


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
    entries, problems = [], []
    for i, entry in enumerate(value):
        entry = dict(entry) if isinstance(entry, (Mapping, ConfigDict)) else entry
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            problems.append(f"data.mixture[{i}]={entry!r} must be a dict with path and weight")
            continue
        unknown = sorted(set(entry) - {"path", "weight", *ENTRY_KEYS})
        if unknown:
            problems.append(f"data.mixture[{i}] has unknown key(s) {', '.join(unknown)}; known: path, weight, "
                            f"{', '.join(ENTRY_KEYS)}")
            continue
        entries.append(entry)
    return entries, problems


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


def open_collection(src: Source, seq_len: int):
    """The source's documents as a random-access collection (not for "datasets")."""
    if src.source == "stdlib":
        root, rel_paths = stdlib_files()
        return FileDocuments(root, rel_paths, encoder_of(src), limit=int(src.max_corpus_bytes))
    if src.source == "text":
        return SpanDocuments(text_files(src.path), encoder_of(src), per_line=src.text_documents == "line",
                             text_field=src.text_field)
    tokens = np.memmap(src.path, dtype=np.dtype(src.token_dtype), mode="r")
    offsets = _token_offsets(src, tokens)
    return TokenWindows(tokens, seq_len + 1) if offsets is None else TokenDocuments(tokens, offsets)


def open_stream(src: Source, seq_len: int, seed: int, *, train: bool, keep=None):
    if src.source == "datasets":
        return hf_stream.DatasetStream(hf_stream.dataset_files(src.path, src.key), encoder_of(src),
                                       text_field=src.text_field, seed=seed, train=train, keep=keep, name=src.key)
    return IndexedStream(open_collection(src, seq_len), seed=seed, train=train, keep=keep, name=src.key)


def training_stream(config):
    """The training documents: endless, shuffled by `train.seed`, without the held-out share."""
    seq_len, seed = config.train.seq_len, config.train.seed
    keep = HoldOut(config.eval.share, eval=False) if config.eval.share > 0 else None
    sources = training_sources(config.data)
    streams = [open_stream(src, seq_len, seed, train=True, keep=keep) for src in sources]
    return streams[0] if len(streams) == 1 else MixtureStream(streams, [src.weight for src in sources], seed)


def eval_stream(config):
    """The eval documents, in a fixed order, once: `eval.path`, or the held-out share of every
    training source (in source order). None without eval."""
    seq_len, seed = config.train.seq_len, config.train.seed
    src = eval_source(config)
    if src is not None:
        return open_stream(src, seq_len, seed, train=False)
    if config.eval.share <= 0:
        return None
    keep = HoldOut(config.eval.share, eval=True)
    streams = [open_stream(s, seq_len, seed, train=False, keep=keep) for s in training_sources(config.data)]
    return streams[0] if len(streams) == 1 else ChainStream(streams)


def eval_batches(config) -> Packer | None:
    """A fresh iterator over the eval set's global batches (the last one padded), packed as
    training packs; None without eval."""
    stream = eval_stream(config)
    if stream is None:
        return None
    train = config.train
    return Packer(stream, train.global_batch_size, train.seq_len + 1, bool(config.data.packing))


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


# ---------------------------------------------------------------- checks


def _source_settings_problems(src: Source, vocab: int) -> list[str]:
    errors = one_of("data.source" if src.key in ("data.path", "eval.path") else src.key.replace(".path", ".source"),
                    src.source, SOURCES)
    if errors:
        return errors
    errors += source_problems(src, key=src.key)
    errors += one_of("data.text_documents", src.text_documents, TEXT_DOCUMENTS)
    if not src.text_field:
        errors.append("data.text_field is empty; name the field of each record that holds its text")
    errors += within("data.eos_id", src.eos_id, -1, vocab - 1)
    if src.tokenizer and not os.path.isdir(src.tokenizer):
        errors.append(f"data.tokenizer={src.tokenizer!r} is not a directory; point it at a saved tokenizer, or '' for bytes")
    if src.source in TEXT_SOURCES and not src.tokenizer and vocab < ByteTokenizer.vocab_size:
        errors.append(
            f"model.vocab_size={vocab} is below the byte tokenizer's {ByteTokenizer.vocab_size} "
            f"(data.source={src.source!r}, data.tokenizer=''); set model.vocab_size >= 256 or data.tokenizer"
        )
    return errors


def validate_data_config(config) -> list[str]:
    """One-line problems with `config.data` / `config.eval` and their fit with `config.model`;
    stats paths, reads no corpus."""
    data, evaluation, vocab = config.data, config.eval, int(config.model.vocab_size)
    errors = []
    if str(data.token_dtype) not in TOKEN_DTYPES:
        errors.append(f"data.token_dtype={data.token_dtype!r} is not one of {TOKEN_DTYPES}; set data.token_dtype")
    entries, problems = mixture_entries(data.mixture)
    errors += problems
    if entries and data.path:
        errors.append(f"data.path={data.path!r} and data.mixture are both set; use data.mixture alone (or data.path)")
    for i, entry in enumerate(entries):
        if not isinstance(entry["weight"], (int, float)) or isinstance(entry["weight"], bool) or entry["weight"] <= 0:
            errors.append(f"data.mixture[{i}].weight={entry['weight']!r} must be a number > 0")
    if not problems:
        for src in training_sources(data):
            errors += _source_settings_problems(src, vocab)
    errors += within("eval.share", evaluation.share, 0.0, 1.0, high_open=True)
    errors += at_least("eval.every_steps", evaluation.every_steps, 0) + at_least("eval.steps", evaluation.steps, 0)
    if evaluation.path and evaluation.share > 0:
        errors.append(f"eval.path={evaluation.path!r} and eval.share={evaluation.share} are both set; hold out one way")
    if evaluation.every_steps > 0 and not eval_enabled(config):
        errors.append(f"eval.every_steps={evaluation.every_steps} but there is no eval set; set eval.path or eval.share")
    if evaluation.path:
        errors += source_problems(eval_source(config), key="eval.path")
    return list(dict.fromkeys(errors))


def _record_field_problems(src: Source) -> list[str]:
    """The first record of every file of a record source must hold `data.text_field`."""
    if src.source == "datasets":
        if not installed("datasets"):
            return [missing_line("datasets", f"{src.key.replace('path', 'source')}='datasets'")]
        files = hf_stream.dataset_files(src.path, src.key)
    elif src.source == "text":
        files = [f for f in text_files(src.path) if f.endswith(".jsonl")]
    else:
        return []
    for path in files:
        try:
            fields = _first_record_fields(path, src)
        except DataError as e:
            return [str(e)]
        except Exception as e:  # noqa: BLE001 - a file `datasets` / pyarrow cannot read
            return [f"{src.key}: {path} cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"]
        if fields is not None and src.text_field not in fields:
            return [f"{src.key}: the records of {path} have no {src.text_field!r} field (they have "
                    f"{', '.join(map(str, fields)) or 'none'}); set data.text_field"]
    return []


def _first_record_fields(path: str, src: Source):
    """The field names of a file's first record (None: the file has no record)."""
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    record_text(line, src.text_field, f"{src.key}: {path} line 1")
                    return [src.text_field]
        return None
    if path.endswith(".parquet"):
        import pyarrow.parquet

        return pyarrow.parquet.read_schema(path).names
    record = hf_stream.first_record(path)
    return None if record is None else list(record)


def _first_document(src: Source, seq_len: int, keep) -> bool:
    """Whether training can read one document (of 2+ tokens, outside the held-out share)."""
    stream = open_stream(src, seq_len, 0, train=False, keep=keep)
    return next(stream, None) is not None


def _source_problems(src: Source, config) -> list[str]:
    """The reading preflight of one training source."""
    vocab, train = int(config.model.vocab_size), config.train
    errors = []
    if src.source == "tokens":
        errors += token_file_problems(src.path, src.token_dtype, vocab)
        errors += _offsets_problems(src)
        if errors:
            return errors
    if src.source in TEXT_SOURCES:
        try:
            encoder = encoder_of(src)
        except TokenizerError as e:
            return [str(e)]
        if encoder.vocab_size > vocab:
            return [f"data.tokenizer={src.tokenizer!r} has {encoder.vocab_size} tokens, more than "
                    f"model.vocab_size={vocab}; {vocab_size_fix(encoder.vocab_size)}"]
        errors += _record_field_problems(src)
        if errors:
            return errors
    known_in_tokens = src.source == "tokens" or (src.source in ("stdlib", "text") and not src.tokenizer)
    width = train.seq_len + 1
    if known_in_tokens and src.key == "data.path":
        available = source_tokens(src)
        if available < train.global_batch_size * width:
            where = "the stdlib corpus" if src.source == "stdlib" else f"{src.key}={src.path!r}"
            return [
                f"{where} holds {available} tokens, fewer than one global batch of train.global_batch_size="
                f"{train.global_batch_size} rows of train.seq_len+1={width}; use a larger corpus or lower "
                f"train.seq_len / train.global_batch_size" + (" (or raise data.max_corpus_bytes)" if src.source == "stdlib" else "")
            ]
    if src.source == "tokens":
        errors += token_range_problems(src.path, src.token_dtype, vocab, key=src.key)
        if errors:
            return errors
    keep = HoldOut(config.eval.share, eval=False) if config.eval.share > 0 else None
    try:
        if not _first_document(src, train.seq_len, keep):
            held = " outside the eval.share held out" if keep is not None else ""
            errors.append(f"{src.key}={src.path!r} holds no document of 2 or more tokens{held}; check the corpus"
                          + (" and data.text_field" if src.source in ("datasets", "text") else ""))
    except DataError as e:
        errors.append(str(e))
    return errors


def _offsets_problems(src: Source) -> list[str]:
    side = offsets_path(src.path)
    if not os.path.isfile(side):
        return []
    try:
        offsets = np.load(side, mmap_mode="r")
    except (OSError, ValueError) as e:
        return [f"{src.key}={src.path!r} has an unreadable offsets sidecar {side} ({type(e).__name__}); regenerate it"]
    count = os.path.getsize(src.path) // np.dtype(src.token_dtype).itemsize
    if offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != count or np.any(np.diff(offsets) < 0):
        return [f"{src.key}={src.path!r}: its offsets sidecar {side} does not cut its {count} tokens into documents; "
                f"regenerate both with scripts/prepare_data.py"]
    return []


def _eval_problems(config) -> list[str]:
    """An eval set that exists and is long enough for `eval.steps` batches."""
    where = f"eval.path={config.eval.path!r}" if config.eval.path else f"the eval.share={config.eval.share} held out"
    src = eval_source(config)
    if src is not None and src.source == "tokens":
        vocab = int(config.model.vocab_size)
        errors = token_file_problems(src.path, src.token_dtype, vocab) + _offsets_problems(src)
        errors = [e.replace("data.path", "eval.path") for e in errors]
        errors = errors or token_range_problems(src.path, src.token_dtype, vocab, key="eval.path")
        if errors:
            return errors
    if src is not None and src.source in TEXT_SOURCES:
        errors = _record_field_problems(src)
        if errors:
            return errors
    try:
        batches = eval_batches(config)
        wanted = max(int(config.eval.steps), 1)
        found = sum(1 for _, _ in zip(range(wanted), batches))
    except DataError as e:
        return [str(e)]
    if found == 0:
        return [f"{where} holds no document of 2 or more tokens; give an eval set (eval.path or eval.share)"]
    if found < config.eval.steps:
        return [f"{where} packs into {found} batches of train.global_batch_size={config.train.global_batch_size} rows, "
                f"fewer than eval.steps={config.eval.steps}; lower eval.steps or set it to 0 (the whole eval set once)"]
    return []


def corpus_problems(config) -> list[str]:
    """The corpus preflight (module docstring); reads, never writes."""
    errors = validate_data_config(config)
    if errors:
        return errors
    for src in training_sources(config.data):
        errors += _source_problems(src, config)
    if not errors and eval_enabled(config):
        errors += _eval_problems(config)
    return list(dict.fromkeys(errors))


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
    tokenizers = ", ".join(dict.fromkeys(_tokenizer_of(s) for s in sources))
    where = {s.key: "the Python standard library's source" if s.source == "stdlib" else f"{s.source} {s.path}"
             for s in sources}
    if len(sources) == 1:
        return f"data: {where[sources[0].key]} ({packing}; {tokenizers})"
    total = sum(s.weight for s in sources)
    lines = [f"data: a mixture of {len(sources)} sources, drawn document by document ({packing}; {tokenizers}):"]
    lines += [f"  {where[s.key]}: weight {s.weight:g} ({s.weight / total:.0%} of documents)" for s in sources]
    return "\n".join(lines)


__all__ = ["DataError", "Source", "corpus_fingerprint", "corpus_problems", "corpus_tokens", "corpus_warnings", "eval_batches",
           "eval_stream", "training_stream", "validate_data_config"]
