"""Read and write HF safetensors checkpoints one tensor at a time.

Reading opens the file per tensor (pages of a mapping held open count as resident memory);
writing keeps at most one shard in memory, named ``model-0000i-of-0000N`` once N is known.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

_SAFE_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class ConversionError(ValueError):
    """Bad input to a checkpoint conversion; the message names the file or tensor and the fix."""


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; a file that is not one is named in the error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path} is not valid JSON ({err}); restore or re-create the file") from err
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file, after checking its header covers the whole file
    (a truncated or padded file is caught before anything is written).
    """
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as err:
        raise ConversionError(
            f"{path} ({path.stat().st_size} bytes) is not a readable safetensors file: {err}. It is truncated "
            "or corrupt (an interrupted download or save?); download or save it again"
        ) from err


class HFSafetensorsReader:
    """Lazy access to the tensors of a HF checkpoint directory (single file or sharded)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.directory / SAFE_INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no 'weight_map'")
            files = {name: self.directory / file for name, file in weight_map.items()}
            missing = sorted({str(p) for p in files.values() if not p.is_file()})
            if missing:
                raise ConversionError(f"{index} lists shard files that do not exist: {missing}")
            for shard in sorted(set(files.values())):
                listed = {name for name, file in files.items() if file == shard}
                absent = sorted(listed - set(safetensors_names(shard)))
                if absent:
                    raise ConversionError(f"{index} places tensors in {shard} that it does not hold: {absent[:8]}")
            return files
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            others = sorted(p.name for p in self.directory.glob("*.bin")) + sorted(
                p.name for p in self.directory.glob("*.pt")
            )
            hint = (
                f" It has {others}: re-save it as safetensors first "
                "(model.save_pretrained(dir, safe_serialization=True))."
                if others
                else ""
            )
            raise ConversionError(f"no *.safetensors weights in {self.directory}.{hint}")
        files: dict[str, Path] = {}
        for shard in shards:
            for name in safetensors_names(shard):
                files[name] = shard
        return files

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _file(self, name: str) -> Path:
        if name not in self._file_of:
            raise ConversionError(f"tensor {name!r} is missing from the HF checkpoint {self.directory}")
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self._file(name), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        with safe_open(self._file(name), framework="pt") as f:
            return _SAFE_DTYPES[f.get_slice(name).get_dtype()]

    def read(self, name: str) -> torch.Tensor:
        with safe_open(self._file(name), framework="pt") as f:
            return f.get_tensor(name)


def parse_size(size: str | int) -> int:
    """``"2GB"`` / ``"500MB"`` / ``"1GiB"`` / bytes -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if not match:
        raise ValueError(f"cannot read size {size!r}; use e.g. '2GB', '500MB' or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B")
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(number * powers[unit])


class ShardedSafetensorsWriter:
    """Write tensors into ``model.safetensors`` or ``model-*-of-*.safetensors`` + index."""

    def __init__(self, directory: str | Path, max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buffer or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        tensor = tensor.detach().contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # a view of a larger tensor would save (and pin) all of it
        nbytes = tensor.nbytes
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self._written):05d}.safetensors.tmp"
        save_file(self._buffer, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the files, and write the index when there are several."""
        if self._buffer or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            final = [self.directory / SAFE_SINGLE]
        else:
            final = [self.directory / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        umask = os.umask(0)
        os.umask(umask)
        for (tmp, names), target in zip(self._written, final):
            os.replace(tmp, target)
            os.chmod(target, 0o666 & ~umask)  # safetensors creates files owner-only
            weight_map.update({name: target.name for name in names})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return final
