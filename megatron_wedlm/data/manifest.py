"""A prepared directory's contract: its layout, its ``manifest.json`` and how readers check it.

``tools/prepare_data.py`` (:mod:`.prepare`) writes a prepared directory; the loader, the config's
data check, the engines and the indexed-dataset reader read it through this module alone, so the
contract is written once and none of them imports the preparation. A prepared directory holds:

* ``shard-NNNNNN.tar``: webdataset shards, one sample per document: ``<key>.tokens.npy`` (int32
  ids) and ``<key>.json`` (``prompt_length``, 0 for pretraining, and ``source``, ``file:line``).
* ``tokenizer/`` (:data:`TOKENIZER_DIR`): the tokenizer used, with the mask token added if it had none.
* ``manifest.json`` (:data:`MANIFEST_FILE`): ``format_version``, ``task``, the tokenizer's special
  ids (``mask_token_id``, ``eos_token_id``, ``pad_token_id``, ``mask_token``), ``tokenizer_length``,
  counts, the shard list, the inputs, bad lines by reason and replaced invalid UTF-8; for SFT
  ``end_token_id``, the token the loader appends as learnable end tokens and after which
  ``wedlm.mask_after_masked_end`` masks.
* ``valid/`` (:data:`VALID_DIR`, with ``valid_fraction`` > 0): the held-out documents, a prepared
  directory of its own, for ``data.valid_path``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from megatron_wedlm.runtime.hf_local import tokenizer_files_in

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "TOKENIZER_DIR",
    "VALID_DIR",
    "read_manifest",
    "read_task_manifest",
    "tokenization_difference",
    "tokenization_of",
    "tokenizer_dir_of",
]

MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
VALID_DIR = "valid"  # the held-out documents (valid_fraction > 0), in a part and in the output
FORMAT_VERSION = 1

# Files that do not change what token ids mean: the config holds the chat template and the
# loading options (e.g. the directory it was loaded from), not the vocabulary.
_NOT_VOCABULARY = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")


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


def tokenization_of(data_dir: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What must agree between prepared directories whose rows one model reads (blend sources,
    training and validation data): the task, the special ids, the mask token and a hash of the
    tokenizer's own files (names and bytes; not the config or the chat template, and not the
    weights of a checkpoint directory that holds the tokenizer)."""
    directory = tokenizer_dir_of(data_dir, manifest)
    digest = hashlib.sha256()
    for file in sorted(p for p in tokenizer_files_in(directory) if p.name not in _NOT_VOCABULARY):
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


def tokenization_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first way two :func:`tokenization_of` results differ, as ``"key: a vs b"``; None if they agree."""
    return next((f"{key}: {value!r} vs {b[key]!r}" for key, value in a.items() if b[key] != value), None)


def tokenizer_dir_of(data_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """The tokenizer a prepared directory was tokenized with (the manifest names its subdirectory)."""
    return Path(data_dir) / manifest.get("tokenizer", TOKENIZER_DIR)
