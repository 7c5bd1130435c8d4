"""One part of the input -> tokenized webdataset shards: the work a preparation worker does.

Pretraining text is tokenized with special-token parsing off and EOS appended; SFT conversations
are rendered with the chat template, only the final reply learnt. ``part.json``
(:class:`PartResult`) is written last, so a part directory that has it is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tarfile
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from megatron_wedlm.runtime.atomic_output import writer_tag
from megatron_wedlm.runtime.hf_local import load_tokenizer, read_config, reference_mask_token_id

from .input_formats import SFT_FIELDS, BadLine, Part, Utf8Decoder, part_records
from .manifest import VALID_DIR

__all__ = [
    "DEFAULT_MASK_TOKEN",
    "PART_FILE",
    "PartOptions",
    "PartResult",
    "PrepareOptions",
    "Sample",
    "VALID_DIR",
    "holds_out",
    "cached_run_tokenizer",
    "load_run_tokenizer",
    "load_tokenizer_with_mask",
    "part_dir_name",
    "prepare_part",
    "reply_end_token_id",
]

DEFAULT_MASK_TOKEN = "<|mask|>"
PART_FILE = "part.json"  # written last into a part's directory: the part is complete
_BATCH = 512  # documents tokenized per call (fast tokenizers batch in Rust)


@dataclass
class Sample:
    tokens: list[int]
    prompt_length: int
    source: str


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """What a preparation makes of its input; these options decide the output (a plan with other
    ones is refused), how the run goes is :func:`.prepare.prepare_dataset`'s. ``reply_end`` (SFT):
    the one-token text that ends every reply, recorded as ``end_token_id`` (None: the reply's
    last special token)."""

    task: str = "pretrain"
    samples_per_shard: int = 10_000
    text_field: str = "text"
    text_unit: str = "paragraph"
    add_eos: bool = True
    mask_token: str = DEFAULT_MASK_TOKEN
    chat_template: str | None = None
    raw_sft: bool = False
    encoding_errors: str = "strict"
    valid_fraction: float = 0.0
    reply_end: str | None = None
    max_reported: int = 100


@dataclass(frozen=True, kw_only=True)
class PartOptions(PrepareOptions):
    """How every part of one preparation is read and tokenized (picklable, for the workers)."""

    tokenizer_dir: str

    @classmethod
    def of(cls, options: PrepareOptions, tokenizer_dir: str | Path) -> PartOptions:
        return cls(tokenizer_dir=str(tokenizer_dir), **{f.name: getattr(options, f.name) for f in fields(PrepareOptions)})

    def fingerprint(self) -> str:
        """What a finished part depends on besides its input: these options and the tokenizer
        directory's files (names, sizes and modification times: the directory may be a whole model,
        too large to read for this)."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        directory = Path(self.tokenizer_dir)
        for file in sorted(p for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else []:
            stat = file.stat()
            digest.update(f"{file.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        return digest.hexdigest()[:16]


@dataclass
class PartResult:
    """What one part produced (its ``part.json``)."""

    index: int
    samples: int = 0
    tokens: int = 0
    shards: list[dict[str, Any]] = field(default_factory=list)  # paths relative to the part's directory
    valid_samples: int = 0
    valid_tokens: int = 0
    valid_shards: list[dict[str, Any]] = field(default_factory=list)  # under valid/
    bad_lines: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    reported: list[str] = field(default_factory=list)  # the first max_reported bad lines, as file:line: reason
    invalid_utf8: dict[str, dict[str, int]] = field(default_factory=dict)
    end_token_id: int | None = None  # SFT without reply_end: the first reply's end token (if any)

    @classmethod
    def read(cls, directory: Path) -> PartResult:
        return cls(**json.loads((directory / PART_FILE).read_text()))



def load_tokenizer_with_mask(tokenizer_dir: str | Path, mask_token: str = DEFAULT_MASK_TOKEN):
    """Load an HF tokenizer from a local directory, adding ``mask_token`` if it has no mask token;
    returns ``(tokenizer, mask_token_id, added)``. An added token grows the vocabulary by one row,
    which conversion initialises (a model trained from scratch sizes itself from the tokenizer)."""
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




def _pretrain_texts(part: Part, options: PartOptions, decoder: Utf8Decoder) -> Iterator[tuple[str, str] | BadLine]:
    for item in part_records(part, decoder, columns=[options.text_field], text_unit=options.text_unit):
        if isinstance(item, BadLine):
            yield item
            continue
        number, record = item
        if isinstance(record, str):  # a plain-text document
            yield f"{part.file}:{number}", record
            continue
        bad = _check_text_record(record, options.text_field)
        if bad:
            yield BadLine(part.file, number, bad)
        else:
            yield f"{part.file}:{number}", record[options.text_field]


def _sft_conversations(part: Part, decoder: Utf8Decoder) -> Iterator[tuple[str, list[dict[str, str]]] | BadLine]:
    for item in part_records(part, decoder, columns=SFT_FIELDS, text_unit="line", required=False):
        if isinstance(item, BadLine):
            yield item
            continue
        number, record = item
        if isinstance(record, dict):  # a table row holds every column read; an absent field is null there
            record = {k: v for k, v in record.items() if v is not None}
        conv = _conversation(record)
        if isinstance(conv, str):
            yield BadLine(part.file, number, conv)
        else:
            yield f"{part.file}:{number}", conv


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
    tokenizer, samples: Iterable[Sample | BadLine], summary: PartResult
) -> Iterator[Sample | BadLine]:
    """``samples`` unchanged; the first reply with a special token names ``summary.end_token_id``."""
    for item in samples:
        if summary.end_token_id is None and isinstance(item, Sample):
            summary.end_token_id = _reply_end_token(tokenizer, item)
        yield item


def reply_end_token_id(tokenizer, reply_end: str, task: str) -> int:
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


def load_run_tokenizer(
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



class _ShardWriter:
    """Writes ``shard-%04d.tar`` files of ``samples_per_shard`` samples in webdataset's layout,
    as plain ustar members with a zero mtime, so the same input gives the same bytes."""

    def __init__(self, output_dir: Path, samples_per_shard: int) -> None:
        output_dir.mkdir(exist_ok=True)
        self.output_dir = output_dir
        self.samples_per_shard = samples_per_shard
        self.shards: list[dict[str, Any]] = []
        self._file: io.BufferedWriter | None = None
        self._count = 0
        self._tokens = 0
        self.total = 0

    def _open(self) -> None:
        name = f"shard-{len(self.shards):04d}.tar"
        self._file = open(self.output_dir / name, "wb")
        self.shards.append({"path": name, "samples": 0, "tokens": 0})
        self._count = self._tokens = 0

    def _close(self) -> None:
        if self._file is not None:
            self._file.write(bytes(2 * tarfile.BLOCKSIZE))  # the end-of-archive marker
            self._file.close()
            self.shards[-1].update(samples=self._count, tokens=self._tokens)
            self._file = None

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o444
        assert self._file is not None
        self._file.write(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
        self._file.write(data)
        self._file.write(bytes(-len(data) % tarfile.BLOCKSIZE))

    def write(self, sample: Sample) -> None:
        if self._file is None or self._count == self.samples_per_shard:
            self._close()
            self._open()
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(sample.tokens, dtype=np.int32))
        key = f"{self.total:010d}"
        self._member(f"{key}.tokens.npy", buffer.getvalue())
        self._member(f"{key}.json", json.dumps({"prompt_length": sample.prompt_length, "source": sample.source}).encode())
        self._count += 1
        self._tokens += len(sample.tokens)
        self.total += 1

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards

    def abandon(self) -> None:
        """Close the open shard after a failure, whether or not its last bytes can still be written
        (its directory is about to be deleted; a full disk must not raise again at exit)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file = None


def holds_out(source: str, fraction: float) -> bool:
    """Whether the document at ``source`` (``file:line``) belongs to the held-out split: a hash of
    the source below ``fraction``, the same on every run."""
    digest = hashlib.blake2b(f"wedlm-valid:{source}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


_tokenizers: dict[tuple[str, str, str | None, str, bool], tuple[Any, int, bool]] = {}


def cached_run_tokenizer(options: PartOptions) -> tuple[Any, int, bool]:
    """The run's tokenizer (:func:`load_run_tokenizer`), loaded once per process: a worker
    prepares many parts, and workers forked after the first load inherit it."""
    key = (options.tokenizer_dir, options.mask_token, options.chat_template, options.task, options.raw_sft)
    if key not in _tokenizers:
        _tokenizers[key] = load_run_tokenizer(*key)
    return _tokenizers[key]


def _samples_of(part: Part, options: PartOptions, tokenizer, decoder: Utf8Decoder,
                result: PartResult) -> Iterator[Sample | BadLine]:
    if options.task == "pretrain":
        samples = _pretrain_samples(tokenizer, _pretrain_texts(part, options, decoder), options.add_eos)
    else:
        samples = _sft_samples(tokenizer, _sft_conversations(part, decoder), options.raw_sft)
    if options.reply_end is not None:
        end_id = reply_end_token_id(tokenizer, options.reply_end, options.task)
        return _ending_with(tokenizer, samples, end_id, options.reply_end)
    if options.task == "sft":
        return _recording_end_token(tokenizer, samples, result)
    return samples


def prepare_part(
    options: PartOptions, index: int, part: Part, work_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> PartResult:
    """Tokenize ``part`` into ``work_dir/part-<index>``: written under a temporary name that names
    the writer (host and pid, so a later run can tell a dead writer's leftovers) and renamed when
    complete. ``progress`` gets (documents, tokens) as they are written."""
    tokenizer, mask_id, _ = cached_run_tokenizer(options)
    decoder = Utf8Decoder(options.encoding_errors)
    final = work_dir / part_dir_name(index)
    staging = work_dir / f"{final.name}.tmp-{writer_tag()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    result = PartResult(index=index)
    try:
        samples = _samples_of(part, options, tokenizer, decoder, result)
        _write_samples(samples, staging, options, mask_id, result, progress)
        result.invalid_utf8 = decoder.replaced
        (staging / PART_FILE).write_text(json.dumps(asdict(result)) + "\n")
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return result


def part_dir_name(index: int) -> str:
    return f"part-{index:06d}"


def _write_samples(
    samples: Iterable[Sample | BadLine],
    directory: Path,
    options: PartOptions,
    mask_id: int,
    result: PartResult,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Shard the good samples into ``directory`` (the held-out ones into its ``valid/``); count
    the bad ones, listing the first ``max_reported``, into ``result``."""
    reasons: Counter[str] = Counter()
    writer = _ShardWriter(directory, options.samples_per_shard)
    valid = _ShardWriter(directory / VALID_DIR, options.samples_per_shard) if options.valid_fraction else None
    done_docs = done_tokens = 0
    try:
        for item in samples:
            if isinstance(item, Sample) and mask_id in item.tokens:
                item = BadLine.at(item.source, "contains the mask token")
            if isinstance(item, BadLine):
                result.bad_lines += 1
                reasons[_reason_kind(item.reason)] += 1
                if len(result.reported) < options.max_reported:
                    result.reported.append(str(item))
                continue
            if valid is not None and holds_out(item.source, options.valid_fraction):
                valid.write(item)
                result.valid_samples += 1
                result.valid_tokens += len(item.tokens)
            else:
                writer.write(item)
                result.samples += 1
                result.tokens += len(item.tokens)
            done_docs += 1
            done_tokens += len(item.tokens)
            if progress is not None and done_docs == _BATCH:
                progress(done_docs, done_tokens)
                done_docs = done_tokens = 0
        result.shards = writer.finish()
        if valid is not None:
            result.valid_shards = valid.finish()
    except BaseException:
        writer.abandon()
        if valid is not None:
            valid.abandon()
        raise
    if progress is not None and done_docs:
        progress(done_docs, done_tokens)
    result.bad_by_reason = dict(reasons)


def _reason_kind(reason: str) -> str:
    """Group reasons for the summary ('invalid JSON (Expecting value)' -> 'invalid JSON')."""
    return reason.split(" (")[0]
