"""Reading benchmark records from local files in the layouts the datasets are published in.

Nothing is downloaded: a jsonl, JSON list, parquet or csv file is read as given; a directory is
searched (hidden ones left out) for the files its :class:`Layout` means, joined in path order.
Every file is checked for the columns the benchmark needs, and an error names the file, the
columns and where such a file comes from, so a wrong download is caught before a model loads.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class Layout:
    """What one benchmark's records must hold (``columns``), and which files of a download it reads.

    ``source`` names the hub dataset for errors and docs; ``config``: the hub config's directory
    (``main`` of openai/gsm8k), held by, or being, the directory given; ``splits``: the file names it
    means, shard suffix aside (``test``: ``test-00000-of-00001.parquet``); empty: every data file."""

    task: str
    columns: tuple[str, ...]
    source: str
    config: str | None = None
    splits: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"columns {', '.join(self.columns)} ({self.source})"

    def wanted(self) -> str:
        """The files a directory means, in words: ``file named test.* or test-*.* under main/``."""
        names = "file named " + " or ".join(f"{s}.* or {s}-*.*" for s in self.splits) if self.splits else "data file"
        return names + (f" under {self.config}/" if self.config else "")


def _split(file: str) -> str:
    """The split a file holds, by its name: ``test`` of ``test-00000-of-00001.parquet`` and ``test.jsonl``."""
    name = os.path.basename(file)
    return name[: -len(next(s for s in SUFFIXES if name.endswith(s)))].split("-", 1)[0]


def _tree(path: str) -> list[str]:
    """Every data file under ``path``, hidden directories and files left out, in sorted path order."""
    found = []
    for directory, subdirectories, names in os.walk(path):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        found += [os.path.join(directory, n) for n in names if n.endswith(SUFFIXES) and not n.startswith(".")]
    return sorted(found)


def _selected(path: str, layout: Layout) -> list[str]:
    """The files of directory ``path`` that ``layout`` means (see :class:`Layout`)."""
    files = everything = _tree(path)
    if not files:
        raise ValueError(
            f"{layout.task}: directory {path!r} holds no {'/'.join(SUFFIXES)} file; "
            f"expected {layout.describe()}"
        )
    if layout.config:
        is_config = Path(path).resolve().name == layout.config
        folders = {f: Path(os.path.relpath(f, path)).parts[:-1] for f in files}
        under = [f for f in files if is_config or layout.config in folders[f]]
        files = under or [f for f in files if not folders[f]]  # else only a flat directory's own files
    chosen = [f for f in files if not layout.splits or _split(f) in layout.splits]
    if not chosen:
        found = ", ".join(os.path.relpath(f, path) for f in everything[:8]) + (", ..." if len(everything) > 8 else "")
        raise ValueError(
            f"{layout.task}: directory {path!r} holds no {layout.wanted()}; it holds {found}. Expected "
            f"{layout.describe()}; a file named otherwise can be given itself"
        )
    return chosen


def data_files(path: str, layout: Layout) -> list[str]:
    """The files :func:`read_records` reads for ``path``: the file itself, or those of a directory
    that ``layout`` means (its config's directory, its splits; see :class:`Layout`)."""
    if os.path.isdir(path):
        return _selected(path, layout)
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


def read_records(path: str, layout: Layout, files: list[str] | None = None) -> list[dict[str, Any]]:
    """Every record of ``path`` (a file, or a directory's :func:`data_files`; ``files`` if the caller
    has them already), checked against ``layout``."""
    records = []
    for file in data_files(path, layout) if files is None else files:
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

