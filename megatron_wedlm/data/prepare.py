"""Raw text / chat data -> tokenized webdataset shards that the training loader streams.

What a prepared directory holds (the contract with :mod:`.webdataset_loader`):

* ``shard-000000.tar`` ...: webdataset tar shards. One sample per document: ``<key>.tokens.npy``
  (int32 token ids) and ``<key>.json`` (``{"prompt_length": k, "source": "file:line"}``;
  ``prompt_length`` is 0 for pretraining).
* ``tokenizer/``: the tokenizer used, saved with the mask token added if it had none.
* ``manifest.json``: task, shard list with sample/token counts, ``mask_token_id``,
  ``eos_token_id``, tokenizer length, and how many input lines were skipped and why; for SFT also
  ``end_token_id``, the token that ends a reply (the last special token of the first rendered
  reply, e.g. the chat template's ``<|im_end|>``; EOS for raw pairs; or the token of
  ``reply_end``): the loader appends copies of it as learnable end tokens
  (``wedlm.num_learnable_end_tokens``), and ``wedlm.mask_after_masked_end`` masks after it.
* ``valid/`` (with ``valid_fraction`` > 0): the held-out documents, a prepared directory of its
  own (shards, ``manifest.json``, ``tokenizer/``) for ``data.valid_path``. A document is held
  out when a hash of its source (``file:line`` as recorded, the input path as given) falls below
  the fraction, so the split is the same on every re-run with the same inputs and does not move
  when documents are added elsewhere.

Pretraining inputs: ``.jsonl`` lines ``{"text": ...}`` or plain text files (one document per
file, paragraph or line; see ``text_unit``). Text is tokenized with special-token parsing off,
so a literal ``<|mask|>`` in the data is ordinary text, and the EOS token is appended.

SFT inputs: ``.jsonl`` lines ``{"messages": [{"role", "content"}, ...]}`` whose last message is
the assistant's reply, or ``{"prompt": ..., "response": ...}`` (``"completion"`` is accepted for
``"response"``). The conversation is rendered with the tokenizer's chat template; the prompt is
everything before the final reply (the template's generation prompt included), and only the
final reply is learnt. With ``chat_template=None`` and ``raw_sft=True`` pairs are concatenated
as ``prompt + response + EOS`` (for base-model tasks that have no chat format).

``reply_end`` names the reply's end where it is text before the closing special tokens, such as
the newline that ends every answer of the built-in tasks and stops their decoding: its single token
becomes ``end_token_id``, and a reply whose last token before its closing special tokens is
another one is a bad line (so no sample quietly lacks the end the loader masks after).

Bad input lines (invalid JSON, missing or non-string field, empty text, malformed messages, a
sample with nothing to learn) are skipped; each is reported as ``file:line: reason`` and the
summary counts them by reason.

Input that is not valid UTF-8 stops the run by default, naming ``file:line`` (as HF ``datasets``
and Megatron-LM's ``preprocess_data.py`` do: a silently replaced byte would train the model on
U+FFFD where the data had other text). ``encoding_errors="replace"`` keeps going with U+FFFD in
place of each invalid byte sequence and records, per file, how many bytes on how many lines were
replaced (console, summary and ``manifest.json`` under ``invalid_utf8``).

The output is written into a temporary sibling directory and renamed into place at the end
(:func:`megatron_wedlm.runtime.atomic_output.atomic_output_dir`): inputs are checked first, an
output that overlaps an input is refused, and a failed run (a typo in an input path, no usable
sample, a full disk) leaves an earlier prepared directory exactly as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from megatron_wedlm.runtime.atomic_output import atomic_output_dir, check_output_dir
from megatron_wedlm.runtime.hf_local import load_tokenizer, read_config, reference_mask_token_id

__all__ = [
    "BadLine",
    "InvalidUtf8Error",
    "PrepareSummary",
    "Sample",
    "MANIFEST_FILE",
    "TOKENIZER_DIR",
    "VALID_DIR",
    "DEFAULT_MASK_TOKEN",
    "ENCODING_ERRORS",
    "collect_input_files",
    "holds_out",
    "load_tokenizer_with_mask",
    "prepare_dataset",
    "read_manifest",
    "read_task_manifest",
    "tokenization_of",
    "tokenizer_dir_of",
]

MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
VALID_DIR = "valid"  # <output>/valid: the held-out documents (valid_fraction > 0)
DEFAULT_MASK_TOKEN = "<|mask|>"
FORMAT_VERSION = 1
_JSON_SUFFIXES = (".jsonl", ".json")
_TEXT_UNITS = ("file", "paragraph", "line")
ENCODING_ERRORS = ("strict", "replace")
_BATCH = 512  # documents tokenized per call (fast tokenizers batch in Rust)


@dataclass(frozen=True)
class BadLine:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"

    @classmethod
    def at(cls, source: str, reason: str) -> BadLine:
        """The bad line at ``source``, a sample's ``file:line``."""
        file, _, line = source.rpartition(":")
        return cls(file, int(line), reason)


@dataclass
class Sample:
    tokens: list[int]
    prompt_length: int
    source: str


@dataclass
class PrepareSummary:
    task: str
    output_dir: str
    num_samples: int = 0
    num_tokens: int = 0
    num_shards: int = 0
    mask_token_id: int = -1
    mask_token_added: bool = False
    end_token_id: int | None = None  # SFT: the token that ends a reply (see _reply_end_token)
    reply_end: str | None = None  # SFT: the text named as the reply's end (prepare_dataset's reply_end)
    bad_lines: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    invalid_utf8: dict[str, dict[str, int]] = field(default_factory=dict)  # file -> bytes, lines, first_line
    valid_fraction: float = 0.0
    valid_samples: int = 0  # held out to <output_dir>/valid (not counted in num_samples)
    valid_tokens: int = 0
    valid_shards: int = 0

    def describe(self) -> str:
        lines = [
            f"wrote {self.num_samples} samples ({self.num_tokens} tokens) in {self.num_shards} shards "
            f"to {self.output_dir}",
        ]
        if self.valid_fraction:
            lines.append(
                f"held out {self.valid_samples} samples ({self.valid_tokens} tokens) in {self.valid_shards} shards "
                f"to {Path(self.output_dir) / VALID_DIR} (valid fraction {self.valid_fraction}) for data.valid_path"
            )
        lines += [
            f"mask token id {self.mask_token_id}" + (" (added to the tokenizer)" if self.mask_token_added else ""),
            f"skipped {self.bad_lines} bad lines"
            + (": " + ", ".join(f"{n} {r}" for r, n in sorted(self.bad_by_reason.items())) if self.bad_lines else ""),
        ]
        if self.invalid_utf8:
            replaced = sum(entry["bytes"] for entry in self.invalid_utf8.values())
            lines.append(f"replaced {replaced} invalid UTF-8 bytes by U+FFFD in {len(self.invalid_utf8)} file(s)")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def load_tokenizer_with_mask(tokenizer_dir: str | Path, mask_token: str = DEFAULT_MASK_TOKEN):
    """Load an HF tokenizer from a local directory; add ``mask_token`` if it has no mask token.

    Returns ``(tokenizer, mask_token_id, added)``. An added token grows the vocabulary by one:
    the model's embedding must have that row (conversion pads/initialises it, see
    ``tools/convert_checkpoint.py``; a model trained from scratch sizes itself from the tokenizer).
    """
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist (give a local HF tokenizer directory)")
    tokenizer = load_tokenizer(path)
    added = False
    if tokenizer.mask_token is None:
        # An official WeDLM checkpoint whose config names no mask token: the reference engine's id.
        config = read_config(path) if (path / "config.json").is_file() else {}
        reference = reference_mask_token_id(config, tokenizer)
        added = reference is None
        if not added:
            mask_token = tokenizer.convert_ids_to_tokens(reference)
        tokenizer.add_special_tokens({"mask_token": mask_token})
    mask_id = tokenizer.convert_tokens_to_ids(tokenizer.mask_token)
    if mask_id is None or mask_id == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer in {path}: mask token {tokenizer.mask_token!r} has no id")
    return tokenizer, int(mask_id), added


# --------------------------------------------------------------------------------------------
# Reading inputs
# --------------------------------------------------------------------------------------------


class InvalidUtf8Error(ValueError):
    """Input bytes that are not UTF-8, under ``encoding_errors="strict"``; names file and line."""


class _Utf8Decoder:
    """Decodes input bytes as UTF-8 under one ``encoding_errors`` policy; counts replacements per file."""

    def __init__(self, errors: str) -> None:
        if errors not in ENCODING_ERRORS:
            raise ValueError(f"encoding_errors must be one of {ENCODING_ERRORS}, got {errors!r}")
        self.errors = errors
        self.replaced: dict[str, dict[str, int]] = {}

    def decode(self, raw: bytes, path: Path, line: int) -> str:
        """``raw`` (starting at ``line`` of ``path``) as text; raises or replaces invalid bytes."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            first = err
        if self.errors == "strict":
            at = line + raw.count(b"\n", 0, first.start)
            raise InvalidUtf8Error(
                f"{path}:{at}: invalid UTF-8 (byte 0x{raw[first.start]:02x}): the file is not UTF-8 text. "
                "Convert it (e.g. iconv -f latin1 -t utf-8) or pass --encoding-errors replace to replace "
                "invalid bytes by U+FFFD (counted per file in manifest.json)"
            )
        parts, start, bad_lines = [], 0, set()
        entry = self.replaced.setdefault(str(path), {"bytes": 0, "lines": 0, "first_line": 0})
        while True:
            try:
                parts.append(raw[start:].decode("utf-8"))
                break
            except UnicodeDecodeError as err:
                end, stop = start + err.start, start + err.end
                parts += [raw[start:end].decode("utf-8"), "\ufffd"]
                bad_lines.add(line + raw.count(b"\n", 0, end))
                entry["bytes"] += stop - end
                start = stop
        entry["lines"] += len(bad_lines)
        entry["first_line"] = entry["first_line"] or min(bad_lines)
        return "".join(parts)


def collect_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """Files named directly, plus ``*.jsonl``/``*.json``/``*.txt`` under named directories (sorted)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (*_JSON_SUFFIXES, ".txt"))
            if not found:
                raise FileNotFoundError(f"input directory {path} holds no .jsonl, .json or .txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    if not files:
        raise ValueError("no input files given")
    return files


def _json_lines(path: Path, decoder: _Utf8Decoder) -> Iterator[tuple[int, Any] | BadLine]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            line = decoder.decode(raw, path, number)
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                yield BadLine(str(path), number, f"invalid JSON ({err.msg})")


def _text_documents(path: Path, unit: str, decoder: _Utf8Decoder) -> Iterator[tuple[int, str]]:
    text = decoder.decode(path.read_bytes(), path, 1).replace("\r\n", "\n").replace("\r", "\n")  # as text mode
    if unit == "file":
        if text.strip():
            yield 1, text
        return
    line_no, start_line, buffer = 0, 1, []
    for line_no, line in enumerate(text.splitlines(keepends=True), start=1):
        if unit == "line":
            if line.strip():
                yield line_no, line.rstrip("\n")
            continue
        if line.strip():
            if not buffer:
                start_line = line_no
            buffer.append(line)
        elif buffer:
            yield start_line, "".join(buffer).rstrip("\n")
            buffer = []
    if buffer:
        yield start_line, "".join(buffer).rstrip("\n")


def _pretrain_texts(
    files: Sequence[Path], text_field: str, text_unit: str, decoder: _Utf8Decoder
) -> Iterator[tuple[str, str] | BadLine]:
    for path in files:
        if path.suffix not in _JSON_SUFFIXES:
            for line, text in _text_documents(path, text_unit, decoder):
                yield f"{path}:{line}", text
            continue
        for item in _json_lines(path, decoder):
            if isinstance(item, BadLine):
                yield item
                continue
            number, record = item
            bad = _check_text_record(record, text_field)
            if bad:
                yield BadLine(str(path), number, bad)
            else:
                yield f"{path}:{number}", record[text_field]


def _check_text_record(record: Any, text_field: str) -> str | None:
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    if text_field not in record:
        return f"missing field '{text_field}'"
    if not isinstance(record[text_field], str):
        return f"field '{text_field}' is not a string"
    if not record[text_field].strip():
        return f"empty '{text_field}'"
    return None


def _conversation(record: Any) -> list[dict[str, str]] | str:
    """The record as a message list ending with the assistant reply, or the reason it is bad."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' is not a non-empty list"
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return f"messages[{i}] has no string 'role'"
            if not isinstance(message.get("content"), str):
                return f"messages[{i}] has no string 'content'"
        if messages[-1]["role"] != "assistant":
            return "the last message is not from the assistant (nothing to learn)"
        if len(messages) < 2:
            return "no prompt before the assistant reply"
        if not messages[-1]["content"].strip():
            return "empty assistant reply"
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    response_key = "response" if "response" in record else "completion" if "completion" in record else None
    if "prompt" not in record or response_key is None:
        return "missing field 'messages' (or 'prompt' and 'response')"
    prompt, response = record["prompt"], record[response_key]
    if not isinstance(prompt, str) or not isinstance(response, str):
        return f"'prompt' and '{response_key}' must be strings"
    if not response.strip():
        return f"empty '{response_key}'"
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def _sft_conversations(
    files: Sequence[Path], decoder: _Utf8Decoder
) -> Iterator[tuple[str, list[dict[str, str]]] | BadLine]:
    for path in files:  # all .jsonl/.json: checked by prepare_dataset
        for item in _json_lines(path, decoder):
            if isinstance(item, BadLine):
                yield item
                continue
            number, record = item
            conv = _conversation(record)
            if isinstance(conv, str):
                yield BadLine(str(path), number, conv)
            else:
                yield f"{path}:{number}", conv


# --------------------------------------------------------------------------------------------
# Tokenizing
# --------------------------------------------------------------------------------------------


def _batched(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _pretrain_samples(tokenizer, records: Iterable[tuple[str, str] | BadLine], add_eos: bool) -> Iterator[Sample | BadLine]:
    eos = tokenizer.eos_token_id if add_eos else None
    for batch in _batched(records, _BATCH):
        good = [r for r in batch if not isinstance(r, BadLine)]
        encoded = iter(
            tokenizer([text for _, text in good], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if good
            else []
        )
        for record in batch:
            if isinstance(record, BadLine):
                yield record
                continue
            ids = list(next(encoded))
            if eos is not None:
                ids.append(int(eos))
            yield Sample(tokens=ids, prompt_length=0, source=record[0])


def _render_chat(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], int] | str:
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    prompt, full = _ids(prompt), _ids(full)
    if full[: len(prompt)] != prompt:
        return "the chat template does not render the prompt as a prefix of the full conversation"
    if len(full) <= len(prompt):
        return "the rendered reply has no tokens"
    return full, len(prompt)


def _ids(rendered: Any) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):  # BatchEncoding in newer transformers
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


def _render_raw(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], int] | str:
    if len(messages) != 2:
        return "raw SFT (no chat template) takes one prompt and one response, not a multi-turn conversation"
    encode = lambda text: tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # noqa: E731
    prompt = list(encode(messages[0]["content"]))
    reply = list(encode(messages[1]["content"]))
    if tokenizer.eos_token_id is not None:
        reply.append(int(tokenizer.eos_token_id))
    if not reply:
        return "the reply has no tokens"
    return prompt + reply, len(prompt)


def _special_ids(tokenizer) -> set[int]:
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return special


def _reply_end_token(tokenizer, sample: Sample) -> int | None:
    """The last special token of a rendered reply: what ends a turn (a chat template's
    ``<|im_end|>`` before its trailing newline, or the raw pairs' EOS); None if it has none."""
    special = _special_ids(tokenizer)
    for token in reversed(sample.tokens[sample.prompt_length:]):
        if token in special:
            return int(token)
    return None


def _recording_end_token(
    tokenizer, samples: Iterable[Sample | BadLine], summary: PrepareSummary
) -> Iterator[Sample | BadLine]:
    """``samples`` unchanged; the first reply with a special token names ``summary.end_token_id``."""
    for item in samples:
        if summary.end_token_id is None and isinstance(item, Sample):
            summary.end_token_id = _reply_end_token(tokenizer, item)
        yield item


def _reply_end_token_id(tokenizer, reply_end: str, task: str) -> int:
    """The one token of ``reply_end`` (a special token's text names that token)."""
    if task != "sft":
        raise ValueError("reply_end names the end of an SFT reply; it has no meaning for pretraining data")
    ids = _ids(tokenizer(reply_end, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        raise ValueError(f"reply_end {reply_end!r} is {len(ids)} tokens of this tokenizer ({ids}); it must be one "
                         "token, the last of every reply before its closing special tokens")
    return ids[0]


def _ending_with(tokenizer, samples: Iterable[Sample | BadLine], end_id: int, reply_end: str
                 ) -> Iterator[Sample | BadLine]:
    """``samples``, with a reply whose last token before its closing special tokens is not
    ``end_id`` turned into a bad line."""
    special = _special_ids(tokenizer) - {end_id}
    for item in samples:
        if isinstance(item, Sample):
            reply = list(item.tokens[item.prompt_length:])
            while reply and reply[-1] in special:
                reply.pop()
            if not reply or reply[-1] != end_id:
                item = BadLine.at(item.source, f"the reply does not end with reply_end ({reply_end!r})")
        yield item


def _sft_samples(tokenizer, records, raw: bool) -> Iterator[Sample | BadLine]:
    render = _render_raw if raw else _render_chat
    for record in records:
        if isinstance(record, BadLine):
            yield record
            continue
        source, messages = record
        result = render(tokenizer, messages)
        if isinstance(result, str):
            yield BadLine.at(source, result)
            continue
        tokens, prompt_length = result
        yield Sample(tokens=tokens, prompt_length=prompt_length, source=source)


# --------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------


class _ShardWriter:
    """Writes ``shard-%06d.tar`` files of ``samples_per_shard`` samples; records counts."""

    def __init__(self, output_dir: Path, samples_per_shard: int) -> None:
        import webdataset as wds

        self._wds = wds
        self.output_dir = output_dir
        self.samples_per_shard = samples_per_shard
        self.shards: list[dict[str, Any]] = []
        self._writer = None
        self._count = 0
        self._tokens = 0
        self.total = 0

    def _open(self) -> None:
        name = f"shard-{len(self.shards):06d}.tar"
        self._writer = self._wds.TarWriter(str(self.output_dir / name), encoder=False)
        self.shards.append({"path": name, "samples": 0, "tokens": 0})
        self._count = self._tokens = 0

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self.shards[-1].update(samples=self._count, tokens=self._tokens)
            self._writer = None

    def write(self, sample: Sample) -> None:
        if self._writer is None or self._count == self.samples_per_shard:
            self._close()
            self._open()
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(sample.tokens, dtype=np.int32))
        meta = {"prompt_length": sample.prompt_length, "source": sample.source}
        assert self._writer is not None
        self._writer.write(
            {"__key__": f"{self.total:010d}", "tokens.npy": buffer.getvalue(), "json": json.dumps(meta).encode()}
        )
        self._count += 1
        self._tokens += len(sample.tokens)
        self.total += 1

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards

    def abandon(self) -> None:
        """Close the open shard after a failure, whether or not its last bytes can still be written
        (its directory is about to be deleted; a full disk must not raise again at exit)."""
        if self._writer is not None:
            with contextlib.suppress(OSError):
                self._writer.tarstream.close()
            with contextlib.suppress(OSError):
                if self._writer.own_fileobj is not None:
                    self._writer.own_fileobj.close()
            self._writer = None


def prepare_dataset(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    task: str = "pretrain",
    samples_per_shard: int = 10_000,
    text_field: str = "text",
    text_unit: str = "paragraph",
    add_eos: bool = True,
    mask_token: str = DEFAULT_MASK_TOKEN,
    chat_template: str | None = None,
    raw_sft: bool = False,
    overwrite: bool = False,
    report: Callable[[str], None] | None = None,
    max_reported: int = 100,
    encoding_errors: str = "strict",
    valid_fraction: float = 0.0,
    reply_end: str | None = None,
) -> PrepareSummary:
    """Tokenize ``inputs`` into webdataset shards under ``output_dir``; see the module docstring.

    ``valid_fraction``: the share of documents held out into ``output_dir/valid`` (0: none).
    ``reply_end`` (SFT): the text, one token, that ends every reply before its closing special
    tokens; recorded as ``end_token_id`` (None: the reply's last special token).

    ``report`` receives one line per bad input line (the first ``max_reported``) and per file
    with replaced invalid UTF-8, and is stderr by default. Every input is checked and the
    tokenizer loaded before anything is written; the output replaces an earlier one only when
    complete. Returns the run summary (also stored in ``manifest.json``).
    """
    _check_options(task, text_unit, samples_per_shard)
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    decoder = _Utf8Decoder(encoding_errors)
    report = report or (lambda line: print(line, file=sys.stderr))
    out = Path(output_dir)
    files = _input_files(inputs, task)
    read = [*inputs, *files, tokenizer_dir]
    check_output_dir(out, read, overwrite)
    tokenizer, mask_id, added = _load_tokenizer(tokenizer_dir, mask_token, chat_template, task, raw_sft)
    if task == "pretrain":
        samples = _pretrain_samples(tokenizer, _pretrain_texts(files, text_field, text_unit, decoder), add_eos)
    else:
        samples = _sft_samples(tokenizer, _sft_conversations(files, decoder), raw_sft)

    summary = PrepareSummary(task=task, output_dir=str(out), mask_token_id=mask_id, mask_token_added=added,
                             valid_fraction=valid_fraction)
    if reply_end is not None:
        summary.reply_end, summary.end_token_id = reply_end, _reply_end_token_id(tokenizer, reply_end, task)
        samples = _ending_with(tokenizer, samples, summary.end_token_id, reply_end)
    elif task == "sft":
        samples = _recording_end_token(tokenizer, samples, summary)
    with atomic_output_dir(out, inputs=read, overwrite=overwrite) as staging:
        valid = _ValidSplit(staging / VALID_DIR, samples_per_shard, valid_fraction) if valid_fraction else None
        shards = _write_samples(samples, staging, samples_per_shard, mask_id, summary, report, max_reported, valid)
        if summary.num_samples == 0:
            raise ValueError(f"no usable samples in {len(files)} input file(s); {summary.bad_lines} bad lines")
        summary.num_shards = len(shards)
        summary.invalid_utf8 = decoder.replaced
        if task == "sft" and summary.end_token_id is None:
            summary.end_token_id = tokenizer.eos_token_id
        for file, entry in decoder.replaced.items():
            report(f"{file}:{entry['first_line']}: replaced {entry['bytes']} invalid UTF-8 byte(s) on "
                   f"{entry['lines']} line(s) by U+FFFD")
        tokenizer.save_pretrained(str(staging / TOKENIZER_DIR))
        manifest = _manifest(tokenizer, summary, shards, files, encoding_errors)
        if valid is not None:
            manifest["valid"] = {"path": VALID_DIR, "fraction": valid_fraction, "num_samples": summary.valid_samples,
                                 "num_tokens": summary.valid_tokens}
            _finish_valid_split(valid, tokenizer, summary, manifest)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return summary


def holds_out(source: str, fraction: float) -> bool:
    """Whether the document at ``source`` (``file:line``) belongs to the held-out split: a hash of
    the source below ``fraction``, the same on every run."""
    digest = hashlib.blake2b(f"wedlm-valid:{source}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


class _ValidSplit:
    """The held-out documents' shard writer and the fraction that selects them."""

    def __init__(self, directory: Path, samples_per_shard: int, fraction: float) -> None:
        directory.mkdir()
        self.directory = directory
        self.fraction = fraction
        self.writer = _ShardWriter(directory, samples_per_shard)
        self.shards: list[dict[str, Any]] = []


def _finish_valid_split(valid: _ValidSplit, tokenizer, summary: PrepareSummary, train_manifest: dict[str, Any]) -> None:
    """``valid/``'s tokenizer and manifest: the training manifest's tokenization, its own shards."""
    if summary.valid_samples == 0:
        raise ValueError(
            f"valid_fraction={valid.fraction} held out none of the {summary.num_samples} documents; raise it "
            "(or leave it out for no validation split)"
        )
    summary.valid_shards = len(valid.shards)
    tokenizer.save_pretrained(str(valid.directory / TOKENIZER_DIR))
    manifest = {
        **{k: v for k, v in train_manifest.items() if k != "valid"},
        "num_samples": summary.valid_samples,
        "num_tokens": summary.valid_tokens,
        "shards": valid.shards,
        "held_out": {"fraction": valid.fraction, "training_data": ".."},
        "bad_lines": 0,  # counted in the training directory's manifest
        "bad_by_reason": {},
    }
    (valid.directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def _check_options(task: str, text_unit: str, samples_per_shard: int) -> None:
    if task not in ("pretrain", "sft"):
        raise ValueError(f"task must be 'pretrain' or 'sft', got {task!r}")
    if text_unit not in _TEXT_UNITS:
        raise ValueError(f"text_unit must be one of {_TEXT_UNITS}, got {text_unit!r}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")


def _input_files(inputs: Sequence[str | Path], task: str) -> list[Path]:
    """The input files (:func:`collect_input_files`); SFT reads JSON lines only."""
    files = collect_input_files(inputs)
    if task == "sft":
        for path in files:
            if path.suffix not in _JSON_SUFFIXES:
                raise ValueError(f"SFT input {path} is not .jsonl: SFT data must be JSON lines with 'messages'")
    return files


def _load_tokenizer(
    tokenizer_dir: str | Path, mask_token: str, chat_template: str | None, task: str, raw_sft: bool
) -> tuple[Any, int, bool]:
    """:func:`load_tokenizer_with_mask`, with ``chat_template`` set; SFT without ``raw_sft`` needs a chat template."""
    tokenizer, mask_id, added = load_tokenizer_with_mask(tokenizer_dir, mask_token)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if task == "sft" and not raw_sft and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer in {tokenizer_dir} has no chat template: pass one (--chat-template FILE) "
            "or use raw prompt+response concatenation (--raw-sft)"
        )
    return tokenizer, mask_id, added


def _manifest(
    tokenizer, summary: PrepareSummary, shards: list[dict[str, Any]], files: list[Path], encoding_errors: str
) -> dict[str, Any]:
    """What ``manifest.json`` records: the format, the tokenizer's special ids, the shards and the summary."""
    return {
        "format_version": FORMAT_VERSION,
        "task": summary.task,
        "tokenizer": TOKENIZER_DIR,
        "mask_token": tokenizer.mask_token,
        "mask_token_id": summary.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **({"end_token_id": summary.end_token_id} if summary.task == "sft" else {}),
        **({"reply_end": summary.reply_end} if summary.reply_end is not None else {}),
        "pad_token_id": tokenizer.pad_token_id,
        "tokenizer_length": len(tokenizer),
        "num_samples": summary.num_samples,
        "num_tokens": summary.num_tokens,
        "shards": shards,
        "inputs": [str(f) for f in files],
        "bad_lines": summary.bad_lines,
        "bad_by_reason": summary.bad_by_reason,
        "encoding_errors": encoding_errors,
        "invalid_utf8": summary.invalid_utf8,
    }


def _write_samples(
    samples: Iterable[Sample | BadLine],
    directory: Path,
    samples_per_shard: int,
    mask_id: int,
    summary: PrepareSummary,
    report: Callable[[str], None],
    max_reported: int,
    valid: _ValidSplit | None = None,
) -> list[dict[str, Any]]:
    """Shard the good samples into ``directory`` (the held-out ones into ``valid``'s); count and
    report the bad ones into ``summary``."""
    reasons: Counter[str] = Counter()
    writer = _ShardWriter(directory, samples_per_shard)
    try:
        for item in samples:
            if isinstance(item, Sample) and mask_id in item.tokens:
                item = BadLine.at(item.source, "contains the mask token")
            if isinstance(item, BadLine):
                summary.bad_lines += 1
                reasons[_reason_kind(item.reason)] += 1
                if summary.bad_lines <= max_reported:
                    report(f"skipped {item}")
                elif summary.bad_lines == max_reported + 1:
                    report(f"(further bad lines are counted but not listed; max_reported={max_reported})")
                continue
            if valid is not None and holds_out(item.source, valid.fraction):
                valid.writer.write(item)
                summary.valid_samples += 1
                summary.valid_tokens += len(item.tokens)
                continue
            writer.write(item)
            summary.num_samples += 1
            summary.num_tokens += len(item.tokens)
        shards = writer.finish()
        if valid is not None:
            valid.shards = valid.writer.finish()
    except BaseException:
        writer.abandon()
        if valid is not None:
            valid.writer.abandon()
        raise
    summary.bad_by_reason = dict(reasons)
    return shards


def _reason_kind(reason: str) -> str:
    """Group reasons for the summary ('invalid JSON (Expecting value)' -> 'invalid JSON')."""
    return reason.split(" (")[0]


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared directory, with a clear error when it is not one."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir} is not a prepared dataset (no {MANIFEST_FILE}); run tools/prepare_data.py")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION}; re-run tools/prepare_data.py"
        )
    return manifest



def read_task_manifest(data_dir: str | Path, task: str, key: str) -> dict[str, Any]:
    """The manifest of ``data_dir`` (named by the config key ``key`` in errors), refused with a
    ValueError when it is not a prepared directory or was prepared for another ``task``."""
    try:
        manifest = read_manifest(data_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"{key}: {err}") from None
    if manifest["task"] != task:
        raise ValueError(
            f"{key}={data_dir} holds '{manifest['task']}' data but this is a {task} run; "
            f"prepare it with tools/prepare_data.py --task {task}"
        )
    return manifest


# Files that do not change what token ids mean: the config holds the chat template and the
# loading options (e.g. the directory it was loaded from), not the vocabulary.
_NOT_VOCABULARY = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def tokenization_of(data_dir: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What must agree between prepared directories whose rows one model reads (blend sources,
    training and validation data): the task, the special ids, the mask token and a hash of the
    tokenizer files (names and bytes of every file but the config and the chat template)."""
    directory = tokenizer_dir_of(data_dir, manifest)
    digest = hashlib.sha256()
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in _NOT_VOCABULARY):
        digest.update(str(file.relative_to(directory)).encode() + b"\0" + file.read_bytes() + b"\0")
    return {
        "task": manifest["task"],
        "mask token id": manifest["mask_token_id"],
        "tokenizer length": manifest.get("tokenizer_length"),
        "eos token id": manifest.get("eos_token_id"),
        "pad token id": manifest.get("pad_token_id"),
        "tokenizer files": digest.hexdigest()[:16],
        "mask token": manifest.get("mask_token"),
    }


def tokenizer_dir_of(data_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """The tokenizer a prepared directory was tokenized with (the manifest names its subdirectory)."""
    return Path(data_dir) / manifest.get("tokenizer", TOKENIZER_DIR)
