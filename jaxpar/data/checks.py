"""The data preflight: what a run reads, checked before anything is compiled or written.

`validate_data_config` — the settings alone (paths stat-ed, nothing read): sources, mixture entries
and their weights (finite, > 0), the mixture's stages (`data.mixture_stages`), eval keys.
`corpus_problems` — opens every source: token files' sidecars, offsets and id ranges (against
`model.vocab_size` and the vocabulary the sidecar records), the tokenizer and its vocabulary, the
records of every record file (the first `PREFLIGHT_RECORDS` of each training source, spread over
its files; every record of the eval set: valid UTF-8 JSON with text in `data.text_field`), enough
tokens for one global batch (where the size is known without tokenizing), a first usable document
for training, and an eval set long enough for `eval.steps`.
One line per problem, each naming the key (and the file and line where one is at fault); a
`DataError` met while reading is such a line. What the preflight does not read (a bad record deep in
a large shard) is found by the run, which ends in the same one line (`jaxpar.train.loop`).
"""

from __future__ import annotations

import math
import os

import numpy as np

from jaxpar.data import hf_stream
from jaxpar.data.chat import RecordError, has_generation_markers, prefix_mask
from jaxpar.data.corpus import (
    TEXT_DOCUMENTS,
    Source,
    encoder_of,
    eval_batches,
    eval_enabled,
    eval_source,
    format_of,
    mixture_entries,
    mixture_stages,
    open_stream,
    training_sources,
)
from jaxpar.data.documents import DataError, HoldOut, offsets_path, parse_record, record_text
from jaxpar.data.formats import FORMATS, MASKED_FORMATS
from jaxpar.data.prepare import sidecar_vocab, token_file_problems
from jaxpar.data.sources import SOURCES, TEXT_SOURCES, TOKEN_DTYPES, source_problems, source_tokens, text_files, token_range_problems
from jaxpar.data.tokenizer import ByteTokenizer, TextTokenizer, TokenizerError, vocab_size_fix
from jaxpar.extras import installed, missing_line
from jaxpar.ranges import at_least, one_of, within

# Records of each training source the preflight reads, spread over its files (at least the first of
# each): a bad one further in is found by the run. Bounded so a corpus of many shards starts quickly.
PREFLIGHT_RECORDS = 1000


def _source_settings_problems(src: Source, vocab: int) -> list[str]:
    errors = one_of("data.source" if src.key in ("data.path", "eval.path") else src.key.replace(".path", ".source"),
                    src.source, SOURCES)
    if errors:
        return errors
    errors += source_problems(src, key=src.key)
    errors += one_of("data.text_documents", src.text_documents, TEXT_DOCUMENTS)
    errors += _format_settings_problems(src)
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


def _format_key(src: Source) -> str:
    return "data.format" if src.key in ("data.path", "eval.path") else src.key.replace(".path", ".format")


def _format_settings_problems(src: Source) -> list[str]:
    """A masked `data.format` needs records (the text source's .jsonl files, or the datasets source),
    and chat a tokenizer (its template renders the conversations)."""
    key = _format_key(src)
    errors = one_of(key, src.format, FORMATS)
    if errors or src.format not in MASKED_FORMATS:
        return errors
    if src.source not in ("text", "datasets"):
        return [f"{key}={src.format!r} reads records, but data.source={src.source!r} holds none; use data.source='text' "
                f"(.jsonl files) or 'datasets'"]
    if src.format == "chat" and not src.tokenizer:
        return [f"{key}='chat' renders conversations with a tokenizer's chat template, but data.tokenizer is empty "
                f"(bytes); set data.tokenizer to a tokenizer folder with a chat template"]
    if src.source == "text" and os.path.exists(src.path):
        others = [f for f in text_files(src.path) if not f.endswith(".jsonl")]
        if others:
            return [f"{src.key}: {others[0]} is not a .jsonl file, but {key}={src.format!r} reads JSON records; "
                    f"leave it out or use data.format='text'"]
    return []


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."},
         {"role": "assistant", "content": "Goodbye."}]


def template_problems(src: Source, encoder) -> list[str]:
    """A chat source's tokenizer has a chat template, and one whose assistant tokens can be told:
    with {% generation %} markers, or prefix-stable on a probe conversation."""
    if src.format != "chat" or not isinstance(encoder, TextTokenizer):
        return []
    tokenizer, key = encoder.tokenizer, _format_key(src)
    if not tokenizer.chat_template:
        return [f"data.tokenizer={src.tokenizer!r} has no chat template ({key}='chat' renders conversations with it); "
                f"use a tokenizer folder whose tokenizer_config.json or chat_template.jinja has one"]
    if has_generation_markers(tokenizer):
        return []
    for probe in (PROBE, PROBE[1:]):  # with and without a system prompt (some templates add their own)
        try:
            prefix_mask(tokenizer, probe)
        except RecordError as e:
            return [f"data.tokenizer={src.tokenizer!r}: {e} ({key}='chat', on a probe conversation)"]
    return []


def _weight_problem(i: int, weight) -> str | None:
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if number and math.isfinite(weight) and weight > 0:
        return None
    return f"data.mixture[{i}].weight={weight!r} must be a finite number > 0"


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
    weights = [p for i, entry in enumerate(entries) if (p := _weight_problem(i, entry["weight"]))]
    errors += weights + mixture_stages(data)[1]
    if not problems and not weights:
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


# ---------------------------------------------------------------- records


def record_problems(src: Source, limit: int | None, width: int = 2) -> list[str]:
    """The first problem among the records of a record source's files: `limit` records in all
    (None: every record), spread evenly over the files from the start of each, at least one each;
    a masked `data.format`'s records rendered as training renders them into rows of `width`."""
    try:
        if src.source == "datasets":
            if not installed("datasets"):
                return [missing_line("datasets", f"{src.key.replace('path', 'source')}='datasets'")]
            files = hf_stream.dataset_files(src.path, src.key)
        elif src.source == "text":
            files = [f for f in text_files(src.path) if f.endswith(".jsonl")]
        else:
            return []
        per_file = None if limit is None else max(1, limit // max(len(files), 1))
        checked = format_of(src, width) if src.format in MASKED_FORMATS else None
        for path in files:
            count = _masked_records(path, src, checked, per_file) if checked else _file_records(path, src, per_file)
            if count == 0 and src.source == "datasets":  # `datasets` cannot infer the schema of an empty file
                return [f"{src.key}: {path} holds no record; fill it or leave it out"]
    except DataError as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - a file pyarrow / `datasets` cannot read
        return [f"{src.key}={src.path!r} cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"]
    return []


def _file_records(path: str, src: Source, limit: int | None) -> int:
    """Reads up to `limit` records of one file, checking each; returns how many it read (DataError
    naming the file and record at the first bad one)."""
    if path.endswith(".jsonl"):
        return _jsonl_records(path, src, limit)
    if path.endswith(".parquet"):
        return _parquet_records(path, src, limit)
    count = 0  # .json and .arrow, through `datasets`
    for count, record in enumerate(hf_stream.open_stream([path], key=src.key), 1):
        _text_of(record.get(src.text_field), src, f"{src.key}: {path} record {count}")
        if limit is not None and count >= limit:
            break
    return count


def _masked_records(path: str, src: Source, checked, limit: int | None) -> int:
    """`_file_records` for a masked format: each record rendered (`jaxpar.data.formats`)."""
    count = 0
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{src.key}: {path} line {number}"
                checked.document(parse_record(line, where), lambda where=where: where)
                count += 1
                if limit is not None and count >= limit:
                    break
        return count
    for count, record in enumerate(hf_stream.open_stream([path], key=src.key), 1):
        checked.document(record, lambda count=count: f"{src.key}: {path} record {count}")
        if limit is not None and count >= limit:
            break
    return count


def _text_of(value, src: Source, where: str) -> None:
    if value is None:
        raise DataError(f"{where} has no {src.text_field!r} field; set data.text_field")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {src.text_field!r} is {type(value).__name__}, not text; set data.text_field")


def _jsonl_records(path: str, src: Source, limit: int | None) -> int:
    count = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record_text(line, src.text_field, f"{src.key}: {path} line {number}")
            count += 1
            if limit is not None and count >= limit:
                break
    return count


def _parquet_records(path: str, src: Source, limit: int | None) -> int:
    import pyarrow
    import pyarrow.parquet

    table = pyarrow.parquet.ParquetFile(path)
    names = table.schema_arrow.names
    if src.text_field not in names:
        raise DataError(f"{src.key}: the records of {path} have no {src.text_field!r} field (they have "
                        f"{', '.join(names) or 'none'}); set data.text_field")
    kind = table.schema_arrow.field(src.text_field).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise DataError(f"{src.key}: {path}: field {src.text_field!r} holds {kind}, not text; set data.text_field")
    count = 0
    for batch in table.iter_batches(batch_size=min(limit or 4096, 4096), columns=[src.text_field]):
        nulls = np.flatnonzero(np.asarray(batch.column(0).is_null()))
        if len(nulls) and (limit is None or count + int(nulls[0]) < limit):
            raise DataError(f"{src.key}: {path} record {count + int(nulls[0]) + 1} has no {src.text_field!r} field; "
                            f"set data.text_field")
        count += batch.num_rows
        if limit is not None and count >= limit:
            return limit
    return count


# ---------------------------------------------------------------- sources


def _first_document(src: Source, seq_len: int, keep) -> bool:
    """Whether training can read one document (of 2+ tokens, outside the held-out share)."""
    stream = open_stream(src, seq_len, 0, train=False, keep=keep)
    return next(stream, None) is not None


def _token_file_problems(src: Source, vocab: int) -> list[str]:
    """A token file against its sidecar (dtype, vocabulary, size), then its offsets: the first
    problem found only, since a wrong dtype also miscounts the offsets."""
    errors = token_file_problems(src.path, src.token_dtype, vocab, key=src.key)
    return errors or _offsets_problems(src)


def _source_problems(src: Source, config) -> list[str]:
    """The reading preflight of one training source."""
    vocab, train = int(config.model.vocab_size), config.train
    if src.source == "tokens" and (errors := _token_file_problems(src, vocab)):
        return errors
    if src.source in TEXT_SOURCES:
        try:
            encoder = encoder_of(src)
        except TokenizerError as e:
            return [str(e)]
        if encoder.vocab_size > vocab:
            return [f"data.tokenizer={src.tokenizer!r} has {encoder.vocab_size} tokens, more than "
                    f"model.vocab_size={vocab}; {vocab_size_fix(encoder.vocab_size)}"]
        if errors := template_problems(src, encoder):
            return errors
        if errors := record_problems(src, PREFLIGHT_RECORDS, train.seq_len + 1):
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
    if src.source == "tokens" and (errors := token_range_problems(src.path, src.token_dtype, vocab, key=src.key,
                                                                   sidecar_vocab=sidecar_vocab(src.path))):
        return errors
    keep = HoldOut(config.eval.share, eval=False) if config.eval.share > 0 else None
    try:
        if not _first_document(src, train.seq_len, keep):
            held = " outside the eval.share held out" if keep is not None else ""
            if src.format in MASKED_FORMATS:
                return [f"{src.key}={src.path!r} holds no record with a target in a row of train.seq_len+1={train.seq_len + 1} "
                        f"tokens{held} ({_format_key(src)}={src.format!r}: a prompt longer than a row is skipped); raise "
                        f"train.seq_len or check the corpus"]
            return [f"{src.key}={src.path!r} holds no document of 2 or more tokens{held}; check the corpus"
                    + (" and data.text_field" if src.source in ("datasets", "text") else "")]
    except DataError as e:
        return [str(e)]
    return []


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
    """An eval set that exists, whose every record is readable, long enough for `eval.steps` batches."""
    where = f"eval.path={config.eval.path!r}" if config.eval.path else f"the eval.share={config.eval.share} held out"
    src = eval_source(config)
    if src is not None and src.source == "tokens":
        vocab = int(config.model.vocab_size)
        errors = _token_file_problems(src, vocab)
        errors = errors or token_range_problems(src.path, src.token_dtype, vocab, key="eval.path",
                                                sidecar_vocab=sidecar_vocab(src.path))
        if errors:
            return errors
    if src is not None and src.source in TEXT_SOURCES and (errors := record_problems(src, None, config.train.seq_len + 1)):
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
    try:
        for src in training_sources(config.data):
            errors += _source_problems(src, config)
        if not errors and eval_enabled(config):
            errors += _eval_problems(config)
    except DataError as e:  # anything reading met that the checks above did not name
        errors.append(str(e))
    return list(dict.fromkeys(errors))


__all__ = ["PREFLIGHT_RECORDS", "corpus_problems", "record_problems", "validate_data_config"]
