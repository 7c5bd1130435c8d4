"""Read back a wandb offline run's history rows and summary from ``run-<id>.wandb``, for tests.

wandb (0.31) ships no Python reader; the file is wandb's LevelDB-style ``store`` log (7-byte file header,
32 KiB blocks of CRC-checked record fragments), each record a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

__all__ = ["read_history", "read_records", "read_summary"]

_HEADER = b":W&B"
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order, as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2  # optional dependency, needed only here

    data = Path(path).read_bytes()
    if data[:4] != _HEADER:
        raise ValueError(f"{path} is not a wandb run log (no {_HEADER!r} header)")
    position, chunks, pending = 7, [], b""
    while position + 7 <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        body = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == _FULL:
            chunks.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            chunks.append(pending + body)
    return [wandb_internal_pb2.Record.FromString(chunk) for chunk in chunks]


def _run_logs(run_dir: str | Path) -> list[Path]:
    return sorted(Path(run_dir).glob("**/offline-run-*/run-*.wandb"))


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The run summary as the summary records of every ``offline-run-*`` under ``run_dir`` leave it
    (oldest run first; later updates win, removals drop a key); values decoded from their JSON."""
    summary: dict[str, Any] = {}
    for log in _run_logs(run_dir):
        for record in read_records(log):
            if record.WhichOneof("record_type") != "summary":
                continue
            for item in record.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
            for item in record.summary.remove:
                summary.pop(_key(item), None)
    return summary


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ``run.log`` rows of every ``offline-run-*`` under ``run_dir``, oldest first, values decoded."""
    rows = []
    for log in _run_logs(run_dir):
        for record in read_records(log):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {}
            for item in record.history.item:
                row[_key(item)] = json.loads(item.value_json)
            rows.append(row)
    return rows
