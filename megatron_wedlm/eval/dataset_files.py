"""Reading benchmark records from local files in the layouts the datasets are published in.

Nothing is downloaded. A dataset is read from what a hub download leaves on disk: a jsonl file,
a JSON list, a parquet file (``pyarrow``), a csv file (GPQA's layout), or a directory holding
several of them (the split files of a hub dataset, read in sorted file-name order and joined).
Each record is a dict keyed by column name; every file is checked to have the columns the
benchmark needs, and an error names the file (and line, for jsonl), the columns expected and
where such a file comes from, so a wrong download is caught before any model is loaded.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class Layout:
    """What one benchmark's data file must hold, and where it comes from.

    ``columns`` are required in every record; ``source`` names the hub dataset and the files a
    download holds, for error messages and the docs.
    """

    task: str
    columns: tuple[str, ...]
    source: str

    def describe(self) -> str:
        return f"columns {', '.join(self.columns)} ({self.source})"


def _files(path: str, layout: Layout) -> list[str]:
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, f) for f in os.listdir(path)
            if f.endswith(SUFFIXES) and not f.startswith(".") and os.path.isfile(os.path.join(path, f))
        )
        if not files:
            raise ValueError(
                f"{layout.task}: directory {path!r} holds no {'/'.join(SUFFIXES)} file; "
                f"expected {layout.describe()}"
            )
        return files
    if not os.path.isfile(path):
        raise ValueError(
            f"{layout.task}: data file {path!r} does not exist; expected a local file or directory "
            f"with {layout.describe()}"
        )
    if not path.endswith(SUFFIXES):
        raise ValueError(
            f"{layout.task}: {path!r} is not a {'/'.join(SUFFIXES)} file; expected {layout.describe()}"
        )
    return [path]


def _read_jsonl(path: str, layout: Layout) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{layout.task}: {path}:{lineno} is not valid JSON ({e}); expected one record "
                    f"per line with {layout.describe()}"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{layout.task}: {path}:{lineno} is not a JSON object; expected "
                                 f"{layout.describe()}")
            rows.append((f"{path}:{lineno}", record))
    return rows


def _read_json(path: str, layout: Layout) -> list[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{layout.task}: {path} is not valid JSON ({e}); expected a list of "
                             f"records with {layout.describe()}") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{layout.task}: {path} must hold a JSON list of objects with {layout.describe()}")
    return [(f"{path} record {i}", r) for i, r in enumerate(data)]


def _read_parquet(path: str, layout: Layout) -> list[tuple[str, dict[str, Any]]]:
    try:  # deferred: pyarrow is optional and only parquet files need it
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{layout.task}: reading {path} needs pyarrow (pip install pyarrow), or "
                         "convert it to jsonl") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ValueError(f"{layout.task}: {path} is not a readable parquet file ({e}); expected "
                         f"{layout.describe()}") from None
    return [(f"{path} row {i}", r) for i, r in enumerate(table.to_pylist())]


def _read_csv(path: str, layout: Layout) -> list[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8", newline="") as f:
        return [(f"{path}:row {i}", dict(r)) for i, r in enumerate(csv.DictReader(f), 1)]


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}


def read_records(path: str, layout: Layout) -> list[dict[str, Any]]:
    """Every record of ``path`` (a file or a directory of split files), checked against ``layout``."""
    records = []
    for file in _files(path, layout):
        suffix = next(s for s in SUFFIXES if file.endswith(s))
        for where, record in _READERS[suffix](file, layout):
            missing = [c for c in layout.columns if c not in record]
            if missing:
                raise ValueError(
                    f"{layout.task}: {where} lacks column(s) {missing}; expected {layout.describe()}"
                )
            records.append(record)
    if not records:
        raise ValueError(f"{layout.task}: {path!r} holds no records; expected {layout.describe()}")
    return records


def require(value: Any, kind: type | tuple[type, ...], what: str, layout: Layout) -> Any:
    """``value`` if it has type ``kind``; else an error naming the column and the layout."""
    if not isinstance(value, kind):
        raise ValueError(
            f"{layout.task}: {what} is {type(value).__name__} {value!r:.60}; expected {layout.describe()}"
        )
    return value


def as_list(value: Any, what: str, layout: Layout) -> list[Any]:
    """A list column (parquet gives lists, some exports numpy arrays or tuples) as a list."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if hasattr(value, "tolist"):
        return list(value.tolist())
    raise ValueError(f"{layout.task}: {what} must be a list; expected {layout.describe()}")

