#!/usr/bin/env python
"""Tokenize a corpus (pretraining) or chat records (SFT) into webdataset shards for training.

    python tools/prepare_data.py --input data/ --tokenizer TOKENIZER_DIR --output shards/ --workers 16
    python tools/prepare_data.py --task sft --input chats.jsonl --tokenizer TOKENIZER_DIR --output sft/

Inputs: JSON lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), parquet (``--text-field`` names
the column), Arrow ``save_to_disk`` directories and ``.txt``; a directory is searched for all of
them. ``--workers N`` tokenizes N parts at once. Over several machines, run one job per
``--partition I/N`` (e.g. a SLURM array, all writing to the same --output on a shared file
system), then once ``--merge``:

    python tools/prepare_data.py --input data/ --tokenizer T --output shards/ --partition $SLURM_ARRAY_TASK_ID/8
    python tools/prepare_data.py --output shards/ --merge

A killed or failed run keeps its finished parts in ``OUTPUT.parts/``; the same command goes on.

The output directory gets the shards, ``manifest.json`` and the tokenizer (with a mask token
added if it had none); point ``data.path`` of a training config at it. Bad input lines are
listed as ``file:line: reason`` on stderr and counted in the summary. Input that is not UTF-8
stops the run naming file:line unless ``--encoding-errors replace``. Inputs are checked first and
the output replaces an earlier one only once complete, so a failed run (a mistyped --input, a
full disk) leaves the earlier shards as they were.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from megatron_wedlm.data.prepare import (
    DEFAULT_MASK_TOKEN,
    ENCODING_ERRORS,
    PrepareOptions,
    merge_parts,
    prepare_dataset,
    prepare_partition,
)


def _unescaped(text: str) -> str:
    """``text`` with backslash escapes read as in Python (a shell passes ``\\n`` as two characters)."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as err:
        raise argparse.ArgumentTypeError(f"'{text}' has a broken backslash escape ({err.reason}); "
                                         "escapes are read as in Python, e.g. '\\n' for a newline") from err


def _partition(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        return int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not I/N (e.g. 3/8: the fourth of eight partitions)") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", help="files or directories (.jsonl[.gz|.zst], .parquet, .txt, "
                        "Arrow save_to_disk directories)")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--tokenizer", help="local HF tokenizer (or model) directory")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing at once, one core each")
    parser.add_argument("--partition", type=_partition,
                        help="I/N: prepare only partition I of N (parts p with p %% N == I) and leave the output "
                        "to --merge")
    parser.add_argument("--merge", action="store_true",
                        help="write --output from the parts every --partition job finished")
    parser.add_argument("--part-bytes", type=int,
                        help="about how many input bytes one part holds (uncompressed JSON lines and parquet are "
                        "cut; other files are one part each); default 1/64 of the input, from 1 to 64 MiB")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--task", choices=("pretrain", "sft"), default="pretrain")
    parser.add_argument("--samples-per-shard", type=int, default=10_000)
    parser.add_argument("--text-field", default="text", help="jsonl field holding a pretraining document")
    parser.add_argument(
        "--text-unit", choices=("file", "paragraph", "line"), default="paragraph",
        help="what one document is in plain text files",
    )
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to pretraining documents")
    parser.add_argument("--mask-token", default=DEFAULT_MASK_TOKEN, help="added if the tokenizer has no mask token")
    parser.add_argument("--chat-template", help="jinja chat template file (SFT; overrides the tokenizer's)")
    parser.add_argument("--raw-sft", action="store_true", help="SFT without a chat template: prompt + response + EOS")
    parser.add_argument(
        "--reply-end", type=_unescaped,
        help="SFT: the text, one token, that ends every reply before its closing special tokens (e.g. '\\n' for "
        "replies that end with a newline before the EOS); recorded as the manifest's end_token_id, which "
        "wedlm.mask_after_masked_end masks after; a reply that does not end with it is a bad line. Backslash "
        "escapes are read as in Python. Default: the reply's last special token",
    )
    parser.add_argument("--max-reported", type=int, default=100, help="bad lines listed individually")
    parser.add_argument(
        "--encoding-errors", choices=ENCODING_ERRORS, default="strict",
        help="input that is not UTF-8: stop naming file:line (strict, default) or replace invalid bytes by "
        "U+FFFD and count them per file in manifest.json (replace)",
    )
    parser.add_argument(
        "--valid-fraction", type=float, default=0.0,
        help="hold out this fraction of the documents (by a hash of file:line, stable across re-runs) into "
        "OUTPUT/valid, a prepared directory for data.valid_path (default 0: none)",
    )
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output directory (once the new one is complete)")
    args = parser.parse_args(argv)
    if args.merge and args.partition:
        parser.error("--merge writes the output after every --partition job; give one of them")
    if not args.merge and (not args.input or not args.tokenizer):
        parser.error("--input and --tokenizer are required (only --merge goes without them)")

    try:
        if args.merge:
            print(merge_parts(args.output, overwrite=args.overwrite).describe())
            return 0
        options = PrepareOptions(
            task=args.task,
            samples_per_shard=args.samples_per_shard,
            text_field=args.text_field,
            text_unit=args.text_unit,
            add_eos=not args.no_eos,
            mask_token=args.mask_token,
            chat_template=Path(args.chat_template).read_text() if args.chat_template else None,
            raw_sft=args.raw_sft,
            max_reported=args.max_reported,
            encoding_errors=args.encoding_errors,
            valid_fraction=args.valid_fraction,
            reply_end=args.reply_end,
        )
        run = prepare_dataset if args.partition is None else partial(prepare_partition, partition=args.partition)
        summary = run(args.input, args.output, args.tokenizer, options=options, workers=args.workers,
                      part_bytes=args.part_bytes, overwrite=args.overwrite, show_progress=not args.no_progress)
    except (ValueError, OSError) as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 2
    print(summary.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
