"""The files corpora ship in (JSON lines, plain or ``.gz``/``.zst``; parquet; Arrow
``save_to_disk`` directories; ``.txt`` cut by ``text_unit``), cut into parts that workers prepare
independently.

A record's place is ``file:N`` (the 1-based line or row), so bad input is named where it is and
the held-out split (a hash of the place) is the same whatever the reader. Parts depend on the
files alone, never on the worker count, so the output does not either: uncompressed JSON lines
are cut at line ends and parquet between row groups about every ``part_bytes``; any other file
is one part (a compressed stream cannot be entered in the middle).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = [
    "ARROW_STATE_FILE",
    "BadLine",
    "InputFormatError",
    "InvalidUtf8Error",
    "Part",
    "Utf8Decoder",
    "ENCODING_ERRORS",
    "SFT_FIELDS",
    "collect_input_files",
    "input_format",
    "part_records",
    "plan_parts",
]

ENCODING_ERRORS = ("strict", "replace")
ARROW_STATE_FILE = "state.json"  # what HF datasets' save_to_disk writes next to its data-*.arrow files
SFT_FIELDS = ("messages", "prompt", "response", "completion")
_FORMATS = {  # suffixes (longest first where one ends another) -> format
    ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst", ".json.zst": "jsonl.zst",
    ".jsonl": "jsonl", ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "txt",
}
_READ_CHUNK = 1 << 22  # bytes read at a time when counting lines and decompressing
_ROWS_PER_BATCH = 1024  # rows per Arrow batch (columnar reads; the tokenizer batches 512 documents)


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


class InputFormatError(ValueError):
    """An input file its format's reader cannot read (corrupt, truncated, a missing column)."""


class InvalidUtf8Error(ValueError):
    """Input bytes that are not UTF-8, under ``encoding_errors="strict"``; names file and line."""


class Utf8Decoder:
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


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def input_format(path: Path) -> str | None:
    """The format of ``path`` by its name (see the module docstring); None for other files."""
    name = path.name.lower()
    for suffix, fmt in _FORMATS.items():
        if name.endswith(suffix):
            return fmt
    return None


def _arrow_dataset_files(directory: Path) -> list[Path]:
    """The data files of an HF ``save_to_disk`` directory, in the dataset's order (its state.json)."""
    state_file = directory / ARROW_STATE_FILE
    try:
        state = json.loads(state_file.read_text())
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputFormatError(f"{state_file}: not an HF datasets save_to_disk state ({err}); save the dataset "
                               "again with Dataset.save_to_disk, or name its .arrow files directly") from None
    for file in files:
        if not file.is_file():
            raise InputFormatError(f"{state_file} lists {file.name}, which is missing; copy the whole directory")
    return files


def collect_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """Files named directly, plus the files of a known format under named directories (sorted; an
    Arrow ``save_to_disk`` directory contributes its data files in its own order)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and (path / ARROW_STATE_FILE).is_file():
            files.extend(_arrow_dataset_files(path))
        elif path.is_dir():
            if (path / "dataset_dict.json").is_file():
                raise InputFormatError(f"{path} is an HF DatasetDict; name one of its splits (e.g. {path}/train)")
            found = []
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                if (file.parent / ARROW_STATE_FILE).is_file():
                    continue  # taken below in the dataset's order
                if input_format(file) is not None:
                    found.append(file)
            for state in sorted(path.rglob(ARROW_STATE_FILE)):
                found.extend(_arrow_dataset_files(state.parent))
            if not found:
                raise FileNotFoundError(f"input directory {path} holds no files of a known format "
                                        f"({', '.join(_FORMATS)} or save_to_disk directories)")
            files.extend(found)
        elif path.is_file():
            if input_format(path) is None:
                raise InputFormatError(f"input {path}: unknown format; name files ending in {', '.join(_FORMATS)}")
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    if not files:
        raise ValueError("no input files given")
    return files


# --------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A piece of one input file: bytes ``[start, end)`` of a JSON lines file, row groups
    ``[start, end)`` of a parquet file, or the whole file (``end`` -1); ``first`` numbers its
    first line or row."""

    file: str
    format: str
    start: int = 0
    end: int = -1
    first: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _jsonl_parts(path: Path, part_bytes: int) -> list[Part]:
    """Cut an uncompressed JSON lines file at the first line end after every ``part_bytes``."""
    size = path.stat().st_size
    parts, start, line = [], 0, 1
    with open(path, "rb") as handle:
        while start < size:
            target = start + part_bytes
            if target >= size:
                end = size
            else:
                handle.seek(target)
                handle.readline()  # to the end of the line the target falls in
                end = min(handle.tell(), size)
            parts.append(Part(str(path), "jsonl", start, end, line))
            handle.seek(start)
            remaining, lines = end - start, 0
            while remaining:
                chunk = handle.read(min(_READ_CHUNK, remaining))
                remaining -= len(chunk)
                lines += chunk.count(b"\n")
            start, line = end, line + lines
    return parts


def _parquet_file(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
        raise InputFormatError(f"{path}: not a readable parquet file ({err}); re-download or re-write it, or "
                               "leave it out of --input") from None


def _parquet_parts(path: Path, part_bytes: int) -> list[Part]:
    meta = _parquet_file(path).metadata
    parts, start, rows, size, first = [], 0, 0, 0, 1
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        rows += meta.row_group(group).num_rows
        if size >= part_bytes or group == meta.num_row_groups - 1:
            parts.append(Part(str(path), "parquet", start, group + 1, first))
            start, first, size = group + 1, rows + 1, 0
    return parts


def plan_parts(files: Sequence[Path], part_bytes: int) -> list[Part]:
    """The parts of ``files``, in input order (see the module docstring)."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    parts: list[Part] = []
    for path in files:
        fmt = input_format(path)
        if fmt == "jsonl":
            parts.extend(_jsonl_parts(path, part_bytes))
        elif fmt == "parquet":
            parts.extend(_parquet_parts(path, part_bytes))
        else:
            parts.append(Part(str(path), fmt or "txt"))
    return parts


# --------------------------------------------------------------------------------------------
# Reading a part
# --------------------------------------------------------------------------------------------


def _lines_of(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines (with their newline) of a byte stream given in chunks."""
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


def _byte_range(path: Path, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        handle.seek(start)
        remaining = end - start
        while remaining > 0:
            chunk = handle.read(min(_READ_CHUNK, remaining))
            if not chunk:
                raise InputFormatError(f"{path} ended at byte {end - remaining}, before byte {end}: the file "
                                       "changed while it was read; restart the preparation")
            remaining -= len(chunk)
            yield chunk


def _gzip_chunks(path: Path) -> Iterator[bytes]:
    try:
        with gzip.open(path, "rb") as handle:
            while chunk := handle.read(_READ_CHUNK):
                yield chunk
    except (OSError, EOFError) as err:  # BadGzipFile is an OSError; a cut-off stream an EOFError
        raise InputFormatError(f"{path}: corrupt or truncated gzip ({err}); re-download it or leave it out "
                               "of --input") from None


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of every zstd frame in ``path``; a file that ends inside a frame is
    refused (the library's stream reader would end there silently)."""
    try:
        import zstandard
    except ImportError:
        raise InputFormatError(f"{path}: reading zstd needs the zstandard package: pip install -e '.[data]'") from None

    decompressor = zstandard.ZstdDecompressor()
    try:
        with open(path, "rb") as handle:
            frame, pending = decompressor.decompressobj(), False
            while data := handle.read(_READ_CHUNK):
                while data:
                    out = frame.decompress(data)
                    pending = True
                    if out:
                        yield out
                    data = b""
                    if frame.eof:  # the frame ended: what follows starts the next one
                        data, frame, pending = frame.unused_data, decompressor.decompressobj(), False
        if pending:
            raise InputFormatError(f"{path}: truncated zstd stream (it ends inside a frame); re-download it or "
                                   "leave it out of --input")
    except zstandard.ZstdError as err:
        raise InputFormatError(f"{path}: corrupt zstd data ({err}); re-download it or leave it out of --input") from None


def _json_records(part: Part, decoder: Utf8Decoder) -> Iterator[tuple[int, Any] | BadLine]:
    path = Path(part.file)
    if part.format == "jsonl.gz":
        chunks = _gzip_chunks(path)
    elif part.format == "jsonl.zst":
        chunks = _zstd_chunks(path)
    else:
        end = path.stat().st_size if part.end < 0 else part.end
        chunks = _byte_range(path, part.start, end)
    for number, raw in enumerate(_lines_of(chunks), start=part.first):
        line = decoder.decode(raw, path, number)
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            yield BadLine(str(path), number, f"invalid JSON ({err.msg})")


def _columns_read(path: Path, names: Sequence[str], columns: Sequence[str], required: bool) -> list[str]:
    """Which of ``columns`` the file has; a pretraining column it lacks is refused."""
    present = [c for c in columns if c in names]
    if not present or (required and len(present) < len(columns)):
        wanted = " or ".join(repr(c) for c in columns)
        hint = "choose it with --text-field" if required else "SFT reads 'messages' or 'prompt' and 'response'"
        raise InputFormatError(f"{path} has no column {wanted} (its columns: {', '.join(names)}); {hint}")
    return present


def _table_records(part: Part, columns: Sequence[str], required: bool) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa

    path = Path(part.file)
    number = part.first
    try:
        if part.format == "parquet":
            handle = _parquet_file(path)
            read = _columns_read(path, handle.schema_arrow.names, columns, required)
            batches = handle.iter_batches(batch_size=_ROWS_PER_BATCH, row_groups=range(part.start, part.end),
                                          columns=read)
        else:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            read = _columns_read(path, reader.schema.names, columns, required)
            batches = (batch.select(read) for batch in reader)
        for batch in batches:
            for row in batch.to_pylist():
                yield number, row
                number += 1
    except (pa.ArrowException, OSError) as err:
        raise InputFormatError(f"{path}: unreadable {part.format} data near row {number} ({err}); re-download or "
                               "re-write it, or leave it out of --input") from None


def _text_documents(part: Part, unit: str, decoder: Utf8Decoder) -> Iterator[tuple[int, str]]:
    path = Path(part.file)
    text = decoder.decode(path.read_bytes(), path, 1).replace("\r\n", "\n").replace("\r", "\n")  # as text mode
    if unit == "file":
        if text.strip():
            yield 1, text
        return
    start_line, buffer = 1, []
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


def part_records(
    part: Part, decoder: Utf8Decoder, *, columns: Sequence[str], text_unit: str, required: bool = True
) -> Iterator[tuple[int, Any] | BadLine]:
    """The records of ``part`` with their line or row numbers: JSON values, dicts of ``columns``
    or documents' text. An unparsable JSON line is a :class:`BadLine`; an unreadable file raises
    :class:`InputFormatError`."""
    if part.format == "txt":
        yield from _text_documents(part, text_unit, decoder)
    elif part.format in ("parquet", "arrow"):
        yield from _table_records(part, columns, required)
    else:
        yield from _json_records(part, decoder)
