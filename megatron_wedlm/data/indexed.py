"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) read as pretraining data, as they
are, since such corpora are often too large to tokenize again (docs/training.md, "Megatron indexed
datasets"). :func:`indexed_manifest` gives a prefix a manifest of a prepared directory's shape,
with *virtual* shards of ``documents_per_shard`` documents (``documents:START:END``), so nothing
downstream knows the difference. Checked before training: both files whole, every id below the
tokenizer's length, no mask token, every document ending with EOS unless ``data.append_eod``; the
token scan is cached per file path, size and mtime, one process per node scanning.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_wedlm.runtime.cache import default_cache_dir
from megatron_wedlm.runtime.hf_local import tokenizer_files_in

from .manifest import read_manifest, read_task_manifest
from .tokenize_part import load_tokenizer_with_mask

__all__ = [
    "DEFAULT_DOCUMENTS_PER_SHARD",
    "indexed_file_sizes",
    "indexed_files",
    "indexed_manifest",
    "is_indexed_prefix",
    "open_indexed",
    "prefix_refusal",
    "read_source_manifest",
    "read_source_task_manifest",
    "shard_documents",
    "shard_range",
    "tokenizer_manifest",
]

#: tools/prepare_data.py's default ``--samples-per-shard``: the same documents, the same shards.
DEFAULT_DOCUMENTS_PER_SHARD = 10_000
#: Tokens per vectorised pass of the check over the ``.bin`` (256 MB of int32 ids).
SCAN_CHUNK_TOKENS = 64 << 20
#: Documents per pass over their last tokens (the end-of-document check; 32 MB per int64 array).
_DOCUMENT_CHUNK = 4 << 20
_SHARD_PREFIX = "documents:"
#: Part of the check cache's key: raised whenever the check records something else.
_CACHE_FORMAT = 1
_AFTER_EOD = ("re-run Megatron-LM's tools/preprocess_data.py with --append-eod, or set data.append_eod=true "
              "to have the loader append EOS to every document that lacks it")
_WHERE_MASK = ("the tokenizer/ of a directory tools/prepare_data.py prepared with this tokenizer, or the "
               "directory tools/convert_checkpoint.py hf-to-megatron wrote, holds it with the mask token added")


# --------------------------------------------------------------------------------------------
# Naming
# --------------------------------------------------------------------------------------------


def indexed_files(prefix: str | Path) -> tuple[Path, Path]:
    """``PREFIX.bin`` and ``PREFIX.idx`` (suffixes appended, as Megatron-Core does: a prefix may hold dots)."""
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def is_indexed_prefix(path: str | Path) -> bool:
    """Whether ``path`` names a Megatron indexed dataset: not a directory, and ``PATH.bin`` or
    ``PATH.idx`` exists (a missing partner is named when the prefix is read)."""
    return not Path(path).is_dir() and any(p.exists() for p in indexed_files(path))


def _virtual_shard(start: int, end: int) -> str:
    return f"{_SHARD_PREFIX}{start}:{end}"


def shard_range(path: str) -> tuple[int, int] | None:
    """The documents ``[start, end)`` a virtual shard names; None for a prepared shard's file name."""
    if not path.startswith(_SHARD_PREFIX):
        return None
    start, end = path[len(_SHARD_PREFIX):].split(":")
    return int(start), int(end)


# --------------------------------------------------------------------------------------------
# Any data source: a prepared directory or a prefix
# --------------------------------------------------------------------------------------------


def _refuse_neither(path: str | Path) -> None:
    """A path that is neither a prepared directory nor a prefix, named with what it should be."""
    given = Path(path)
    if given.suffix in (".bin", ".idx") and given.is_file():
        raise ValueError(f"{path} is one file of a Megatron indexed dataset: name its prefix, "
                         f"{str(path)[: -len(given.suffix)]}, without .bin or .idx")
    if not given.exists():
        raise FileNotFoundError(f"{path} does not exist: give a directory written by tools/prepare_data.py or the "
                                "prefix of a Megatron indexed dataset (PATH for PATH.bin and PATH.idx)")


def read_source_manifest(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    documents_per_shard: int = DEFAULT_DOCUMENTS_PER_SHARD,
    append_eod: bool = False,
) -> dict[str, Any]:
    """The manifest of a data source: a prepared directory's ``manifest.json``, or a prefix's
    (:func:`indexed_manifest`, which needs ``tokenizer``: the ``data.*`` keys of the same names)."""
    if not is_indexed_prefix(path):
        _refuse_neither(path)
        return read_manifest(path)
    refusal = prefix_refusal(path, None, None, tokenizer)
    if refusal:
        raise ValueError(refusal)
    return indexed_manifest(path, tokenizer, documents_per_shard=documents_per_shard, append_eod=append_eod)


def read_source_task_manifest(path: str | Path, task: str, key: str, **options: Any) -> dict[str, Any]:
    """:func:`~.manifest.read_task_manifest` for any source (``options``: those of
    :func:`read_source_manifest`); errors name the config key ``key``."""
    if not is_indexed_prefix(path):
        try:
            _refuse_neither(path)
        except (OSError, ValueError) as err:
            raise ValueError(f"{key}: {err}") from None
        return read_task_manifest(path, task, key)
    refusal = prefix_refusal(path, key, task, options.get("tokenizer"))
    if refusal:
        raise ValueError(refusal)
    try:
        return read_source_manifest(path, **options)
    except (OSError, ValueError) as err:
        raise ValueError(f"{key}: {err}") from None


def prefix_refusal(path: str | Path, key: str | None, task: str | None, tokenizer: str | Path | None) -> str | None:
    """Why the prefix ``path`` (config key ``key``) cannot be read in a ``task`` run (None: any
    task) with ``data.tokenizer=tokenizer``, or None. A prefix holds pretraining documents only and
    records no tokenizer; the config check and the readers both ask here."""
    named = f"{key}={path}" if key else str(path)
    if task is not None and task != "pretrain":
        return (f"{named} is a Megatron indexed dataset, whose documents carry no prompt and reply: it serves "
                f"pretraining only; prepare {task} data with tools/prepare_data.py --task {task}")
    if tokenizer is None:
        return (f"{named} is a Megatron indexed dataset ({path}.bin, {path}.idx), which records no tokenizer: set "
                f"data.tokenizer to the HF tokenizer directory it was tokenized with ({_WHERE_MASK})")
    return None


# --------------------------------------------------------------------------------------------
# The tokenizer a prefix was tokenized with
# --------------------------------------------------------------------------------------------

#: tokenizer directory -> (its files' names, sizes and mtimes, the manifest keys it gives)
_tokenizers: dict[str, tuple[list, dict[str, Any]]] = {}


def tokenizer_manifest(tokenizer_dir: str | Path) -> dict[str, Any]:
    """A prefix's manifest but its shards and counts. The tokenizer must hold a mask token:
    checkpoints and exports copy its files, which must name the token the model trains with."""
    path = Path(tokenizer_dir).resolve()
    files = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in tokenizer_files_in(path)] \
        if path.is_dir() else []
    known = _tokenizers.get(str(path))
    if known is not None and known[0] == files:
        return dict(known[1])
    try:
        tokenizer, mask_id, added = load_tokenizer_with_mask(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"data.tokenizer={tokenizer_dir}: {err}") from None
    if added:
        raise ValueError(f"data.tokenizer={tokenizer_dir} has no mask token, and training copies its files into "
                         f"checkpoints and exports, which must name the mask token; {_WHERE_MASK}")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"data.tokenizer={tokenizer_dir} has no EOS token, which must end every document of a "
                         "Megatron indexed dataset (preprocess_data.py --append-eod writes it)")
    header = {
        "task": "pretrain",
        "tokenizer": str(path),
        "mask_token": tokenizer.mask_token,
        "mask_token_id": mask_id,
        "eos_token_id": int(tokenizer.eos_token_id),
        "pad_token_id": tokenizer.pad_token_id,
        "tokenizer_length": len(tokenizer),
    }
    _tokenizers[str(path)] = (files, header)
    return dict(header)


# --------------------------------------------------------------------------------------------
# Opening and checking a prefix
# --------------------------------------------------------------------------------------------

#: real path of a prefix -> (signature of its files, the open IndexedDataset); one per process
_datasets: dict[str, tuple[tuple, Any]] = {}


def _signature(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _described_bytes(dataset: Any) -> int:
    """The ``.bin`` size the index describes: its last sequence's pointer plus its length in bytes."""
    index = dataset.index
    return int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * np.dtype(index.dtype).itemsize


def open_indexed(prefix: str | Path) -> Any:
    """Megatron-Core's ``IndexedDataset`` of ``prefix`` (mmap), kept per process while both files
    are unchanged; refused with what to do when a file is missing or cut short."""
    bin_path, idx_path = indexed_files(prefix)
    missing = [p for p in (bin_path, idx_path) if not p.is_file()]
    if missing:
        there = "neither exists" if len(missing) == 2 else f"{missing[0]} is missing"
        raise FileNotFoundError(
            f"{prefix}: {there}: a Megatron indexed dataset is the pair PREFIX.bin + PREFIX.idx that "
            "preprocess_data.py writes; copy the missing file next to the other, or re-create both"
        )
    signature = (tuple(_signature(bin_path)), tuple(_signature(idx_path)))
    real = signature[0][0]
    known = _datasets.get(real)
    if known is not None and known[0] == signature:
        return known[1]
    size = signature[0][1]
    if size == 0:
        raise ValueError(f"{bin_path} is empty (0 bytes): re-create {prefix}.bin/.idx with preprocess_data.py, or "
                         "the copy was cut short")
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # deferred: Megatron-Core is slow to import

    try:
        dataset = IndexedDataset(str(prefix), multimodal=False, mmap=True)
    except (AssertionError, ValueError, OSError, struct.error) as err:
        raise ValueError(f"{idx_path} cannot be read as a Megatron-Core index ({err or type(err).__name__}): "
                         "re-create the pair with Megatron-LM's tools/preprocess_data.py") from None
    if len(dataset) == 0:
        raise ValueError(f"{idx_path} lists no documents")
    described = _described_bytes(dataset)
    if size != described:
        raise ValueError(
            f"{bin_path} holds {size} bytes but {idx_path} describes {described}: the two files are not one "
            "dataset (re-create both together with preprocess_data.py) or the copy was cut short"
        )
    _datasets[real] = (signature, dataset)
    return dataset


def _scan(dataset: Any, bin_path: Path, eos: int, mask_id: int, documents_per_shard: int) -> dict[str, Any]:
    """One pass over every token of the ``.bin`` (vectorised, :data:`SCAN_CHUNK_TOKENS` at a time)
    and over every document's last token: what :func:`_check_tokens` refuses."""
    index = dataset.index
    itemsize = np.dtype(index.dtype).itemsize
    total = _described_bytes(dataset) // itemsize
    tokens = dataset.bin_reader.read(dtype=index.dtype, count=total, offset=0)  # a view of the mmap
    high, low, masks, shown = -1, 0, 0, 0
    for start in range(0, total, SCAN_CHUNK_TOKENS):
        chunk = tokens[start : start + SCAN_CHUNK_TOKENS]
        high, low = max(high, int(chunk.max())), min(low, int(chunk.min()))
        masks += int(np.count_nonzero(chunk == mask_id))
        done = min(start + SCAN_CHUNK_TOKENS, total)
        if total > SCAN_CHUNK_TOKENS and (done == total or done * 100 // total > shown):  # at most every 1%
            shown = done * 100 // total
            print(f"checking {bin_path}: {done:,} of {total:,} tokens ({shown}%)", file=sys.stderr, flush=True)
    count = len(index.sequence_lengths)
    per_shard = np.zeros(-(-count // documents_per_shard), dtype=np.int64)
    first = None
    for start in range(0, count, _DOCUMENT_CHUNK):
        lengths = index.sequence_lengths[start : start + _DOCUMENT_CHUNK].astype(np.int64)
        last = index.sequence_pointers[start : start + _DOCUMENT_CHUNK] // itemsize + lengths - 1
        ends = np.full(lengths.size, -1, dtype=np.int64)  # an empty document ends with nothing
        ends[lengths > 0] = tokens[last[lengths > 0]]
        lacking = np.flatnonzero(ends != eos) + start
        if lacking.size and first is None:
            first = int(lacking[0])
        per_shard += np.bincount(lacking // documents_per_shard, minlength=per_shard.size)
    without = int(per_shard.sum())
    return {"max_token_id": high, "min_token_id": low, "mask_tokens": masks, "documents_without_eod": without,
            "first_without_eod": first, "without_eod_per_shard": per_shard.tolist() if without else []}


def _cached_scan(dataset: Any, prefix: str | Path, eos: int, mask_id: int, documents_per_shard: int) -> dict[str, Any]:
    """:func:`_scan`, read from the cache when both files are unchanged; one process of a node
    scans while the others wait on the lock, then read its result."""
    bin_path, idx_path = indexed_files(prefix)
    key = {"format": _CACHE_FORMAT, "bin": _signature(bin_path), "idx": _signature(idx_path), "eos_token_id": eos,
           "mask_token_id": mask_id, "documents_per_shard": documents_per_shard}
    directory = default_cache_dir() / "indexed"
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    cache = directory / f"{name}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / f"{name}.lock", "a")  # noqa: SIM115 - held for the with block below
    except OSError:
        return _scan(dataset, bin_path, eos, mask_id, documents_per_shard)  # no writable cache: check each time
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads(cache.read_text())
            if saved.get("key") == key:
                return saved["result"]
        result = _scan(dataset, bin_path, eos, mask_id, documents_per_shard)
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next start a scan
            staging = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
            staging.write_text(json.dumps({"key": key, "result": result}))
            os.replace(staging, cache)  # whole or not at all: a reader never sees half a file
    return result


def _check_tokens(prefix: str | Path, tokenizer_dir: str | Path, header: dict[str, Any], scan: dict[str, Any],
                  documents: int, grouped_documents: int | None, append_eod: bool) -> None:
    """Refuse ids the model has no row for, the mask token in the data, and (unless
    ``append_eod``) documents that do not end with EOS. ``grouped_documents``: how many documents
    the index groups its ``documents`` sequences into, where that is fewer."""
    length, bin_path = header["tokenizer_length"], indexed_files(prefix)[0]
    if scan["max_token_id"] >= length or scan["min_token_id"] < 0:
        bad = scan["max_token_id"] if scan["max_token_id"] >= length else scan["min_token_id"]
        raise ValueError(
            f"{bin_path} holds token id {bad} but data.tokenizer={tokenizer_dir} has {length} tokens (ids 0.."
            f"{length - 1}; the model's vocabulary is sized from it): {prefix} was tokenized with another "
            f"tokenizer. Set data.tokenizer to that one ({_WHERE_MASK})"
        )
    if scan["mask_tokens"]:
        raise ValueError(
            f"{bin_path} holds the mask token {header['mask_token']!r} (id {header['mask_token_id']}) "
            f"{scan['mask_tokens']} times; it marks the slots WeDLM predicts and must not occur in the data. "
            "Tokenize the text with special-token parsing off (as tools/prepare_data.py does)"
        )
    without = scan["documents_without_eod"]
    if without and not append_eod:
        grouped = "" if grouped_documents is None else (
            f" ({prefix}.idx groups its sequences into {grouped_documents} documents, as preprocess_data.py "
            "--split-sentences writes them; each sequence is read as one document)")
        raise ValueError(
            f"{prefix}: {without} of {documents} documents do not end with the EOS token "
            f"(id {header['eos_token_id']}) of data.tokenizer={tokenizer_dir}, the first is document "
            f"{scan['first_without_eod']}{grouped}. Pretraining documents must end with EOS, as tools/prepare_data.py "
            f"writes them: {_AFTER_EOD}"
        )


#: (prefix and tokenizer signatures, options) -> manifest; one per process
_manifests: dict[tuple, dict[str, Any]] = {}


def indexed_manifest(
    prefix: str | Path,
    tokenizer_dir: str | Path,
    *,
    documents_per_shard: int = DEFAULT_DOCUMENTS_PER_SHARD,
    append_eod: bool = False,
) -> dict[str, Any]:
    """The manifest of the prefix ``prefix`` tokenized with ``tokenizer_dir`` (see the module
    docstring), checked; kept per process while the files are unchanged."""
    if documents_per_shard < 1:
        raise ValueError(f"data.indexed_documents_per_shard must be >= 1, got {documents_per_shard}")
    header = tokenizer_manifest(tokenizer_dir)
    dataset = open_indexed(prefix)
    key = (tuple(map(tuple, (_signature(p) for p in indexed_files(prefix)))), json.dumps(header, sort_keys=True),
           documents_per_shard, append_eod)
    if key in _manifests:
        return copy.deepcopy(_manifests[key])
    scan = _cached_scan(dataset, prefix, header["eos_token_id"], header["mask_token_id"], documents_per_shard)
    grouped = len(dataset.document_indices) - 1
    _check_tokens(prefix, tokenizer_dir, header, scan, len(dataset), grouped if grouped != len(dataset) else None,
                  append_eod)
    lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    starts = np.arange(0, lengths.size, documents_per_shard)
    tokens = np.add.reduceat(lengths, starts)
    if append_eod and scan["documents_without_eod"]:
        tokens += np.asarray(scan["without_eod_per_shard"], dtype=np.int64)
    ends = [*starts[1:].tolist(), lengths.size]
    shards = [{"path": _virtual_shard(int(s), e), "samples": e - int(s), "tokens": int(t)}
              for s, e, t in zip(starts, ends, tokens)]
    bin_path, idx_path = indexed_files(prefix)
    manifest = {
        **header,
        "num_samples": int(lengths.size),
        "num_tokens": int(tokens.sum()),
        "shards": shards,
        "indexed": {
            "prefix": str(Path(prefix).resolve()),
            "bin_bytes": bin_path.stat().st_size,
            "idx_bytes": idx_path.stat().st_size,
            "dtype": np.dtype(dataset.index.dtype).name,
            "documents_per_shard": documents_per_shard,
            "append_eod": append_eod,
            "documents_without_eod": scan["documents_without_eod"],
            "max_token_id": scan["max_token_id"],
        },
    }
    _manifests[key] = manifest
    return copy.deepcopy(manifest)


def indexed_file_sizes(prefix: str | Path) -> list[int]:
    """The sizes of ``PREFIX.bin`` and ``PREFIX.idx``, a virtual shard's size in the fingerprint."""
    return [p.stat().st_size if p.is_file() else -1 for p in indexed_files(prefix)]


# --------------------------------------------------------------------------------------------
# Reading a virtual shard
# --------------------------------------------------------------------------------------------


class _ShardDocuments(Sequence):
    """The documents of one virtual shard, read from the mmap on demand: (int64 tokens, prompt
    length 0), with ``eod`` appended to a document that does not end with it (``eod`` < 0: never)."""

    def __init__(self, dataset: Any, start: int, end: int, eod: int) -> None:
        self.dataset, self.start, self.end, self.eod = dataset, start, end, eod

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        tokens = np.asarray(self.dataset[self.start + i], dtype=np.int64)
        if self.eod >= 0 and (tokens.size == 0 or tokens[-1] != self.eod):
            tokens = np.append(tokens, self.eod)
        return tokens, 0


def shard_documents(prefix: str | Path, shard: str, append_eod_id: int = -1) -> Sequence[tuple[np.ndarray, int]]:
    """The documents of the virtual shard ``shard`` of ``prefix``, shaped as a prepared shard's samples."""
    documents = shard_range(shard)
    if documents is None:
        raise ValueError(f"{shard} is not a virtual shard of {prefix} ({_SHARD_PREFIX}START:END)")
    return _ShardDocuments(open_indexed(prefix), *documents, append_eod_id)
