"""Tokenize text into the flat binary `tokens` format for `data.source="tokens"`.

  python scripts/prepare_data.py --tokenizer=/path/to/tokenizer_dir --input=corpus_dir \
      [--input=more.jsonl ...] --output=/data/corpus.bin [--dtype=uint16|uint32] [--overwrite]

Inputs: text files (one document each), .jsonl (one per line) and .json / .parquet / .arrow files
(one per record), each record's --text_field. Writes OUTPUT (token ids, each document wrapped in the
tokenizer's special tokens, EOS last), OUTPUT.offsets.npy (where each document starts; the run cuts
the file into documents by it) and OUTPUT.json (dtype, vocab_size, num_tokens, ...); existing ones
are replaced only with --overwrite. Input is UTF-8: undecodable bytes become U+FFFD and are counted
and reported; a file with more than --max_undecodable of them (binary, another encoding) is refused.
Train on it with --config.data.source=tokens
--config.data.path=OUTPUT --config.data.token_dtype=<the dtype printed at the end>.
"""

import sys

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError
from jaxpar.data.prepare import DTYPES, MAX_UNDECODABLE, PrepareError, prepare, sidecar_path, undecodable_note

FLAGS = (
    Flag("tokenizer", str, "", "local directory of a transformers tokenizer", required=True),
    Flag("input", str, repeat=True, required=True,
         help="text, .jsonl, .json, .parquet or .arrow file, or a folder (repeatable; commas also split)"),
    Flag("text_field", str, "text", "the field of a record that holds its text"),
    Flag("output", str, "", "token file to write (its sidecar goes to OUTPUT.json)", required=True),
    Flag("dtype", str, None, "token dtype; default: the smallest that holds the vocabulary", choices=tuple(DTYPES)),
    Flag("progress", bool, True, "show a progress bar"),
    Flag("overwrite", bool, False, "replace an existing OUTPUT and its sidecar"),
    Flag("max_undecodable", float, MAX_UNDECODABLE, "largest fraction of a file's bytes that may be non-UTF-8 (replaced by U+FFFD)",
         at_least=0.0),
)


def checks(args) -> list[str]:
    if not 0 <= args.max_undecodable <= 1:  # nan too
        return [f"--max_undecodable={args.max_undecodable} must be a fraction in [0, 1]"]
    return []


def run(args, _) -> None:
    inputs = [part for entry in args.input for part in entry.split(",") if part]
    try:
        meta = prepare(
            args.tokenizer, inputs, args.output, args.dtype, progress=args.progress, overwrite=args.overwrite,
            max_undecodable=args.max_undecodable, text_field=args.text_field,
        )
    except PrepareError as e:
        raise UsageError(str(e)) from None
    if (note := undecodable_note(meta)) is not None:
        print(f"prepare_data: warning: {note}", file=sys.stderr)
    print(
        f"wrote {meta['num_tokens']} tokens ({meta['num_documents']} documents, vocab {meta['vocab_size']}) as "
        f"{meta['dtype']} to {args.output} and {sidecar_path(args.output)}; train with --config.data.source=tokens "
        f"--config.data.path={args.output} --config.data.token_dtype={meta['dtype']}"
    )


COMMANDS = (Command(None, "tokenize text into the flat binary tokens format", run, flags=FLAGS, devices=False, checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
