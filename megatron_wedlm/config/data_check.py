"""The config's checks that read the data: run before training, apart from the schema's checks.

Why apart: :func:`~.schema.validate_config` reads no file, so a saved config is re-read (exports,
``--follow``) where the data may be gone. :func:`check_data_files` is what the entry point runs
after loading the config, before any process group exists: it refuses Megatron indexed prefixes
a run cannot read and validation data tokenized otherwise than the training data, naming the
key. A source that is missing is left to the run, which names it when it reads it
(``training/run_data.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .schema import ConfigError, TrainConfig, training_data_dir

__all__ = ["AUTO_VALID_PATH", "check_data_files", "resolve_valid_path"]

AUTO_VALID_PATH = "auto"


def resolve_valid_path(cfg: TrainConfig) -> None:
    """``data.valid_path=auto`` becomes ``<data.path>/valid`` when ``prepare_data.py
    --valid-fraction`` wrote it there, else None (the run then says it validates nothing), so one
    config serves data prepared with or without a held-out part. :func:`~.loading.load_config`
    resolves it, so the saved config names the directory it read."""
    if cfg.data.valid_path != AUTO_VALID_PATH:
        return
    # deferred: a config without validation data imports no data readers
    from megatron_wedlm.data.manifest import MANIFEST_FILE, VALID_DIR

    candidate = Path(cfg.data.path) / VALID_DIR if cfg.data.path and cfg.data.blend is None else None
    cfg.data.valid_path = str(candidate) if candidate and (candidate / MANIFEST_FILE).is_file() else None


def check_data_files(cfg: TrainConfig) -> None:
    """Refuse, with a :class:`ConfigError` naming the key, data sources this run cannot use."""
    _check_indexed_sources(cfg)
    _check_valid_data(cfg)


def _data_sources(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(config key, path) of every data source of the run: training and validation."""
    sources = [("data.path", cfg.data.path)] if cfg.data.blend is None else [
        (f"data.blend[{i}].path", s.path) for i, s in enumerate(cfg.data.blend)]
    if cfg.data.valid_path is not None:
        sources.append(("data.valid_path", cfg.data.valid_path))
    return [(key, path) for key, path in sources if path]  # type: ignore[misc]


def _check_indexed_sources(cfg: TrainConfig) -> None:
    """A Megatron indexed dataset among the sources needs ``data.tokenizer`` and a pretraining run.
    Only prefixes whose files exist are recognised."""
    sources = [(key, path) for key, path in _data_sources(cfg) if not Path(path).is_dir()]
    if not sources:
        return  # prepared directories only: the data readers are not needed
    # deferred: the indexed reader imports numpy and Megatron's formats
    from megatron_wedlm.data.indexed import is_indexed_prefix, prefix_refusal

    for key, path in sources:
        refusal = prefix_refusal(path, key, cfg.trainer.task, cfg.data.tokenizer) if is_indexed_prefix(path) else None
        if refusal:
            raise ConfigError(refusal)


def _check_valid_data(cfg: TrainConfig) -> None:
    """``data.valid_path`` must be tokenized as the training data (``data.path``, or the first
    ``data.blend`` source, which the others match) and prepared for this run's task: validation
    rows are built by the same loader and scored by the same model and objective. A Megatron
    indexed dataset is tokenized as ``data.tokenizer`` says."""
    valid, train = cfg.data.valid_path, training_data_dir(cfg)
    if valid is None:
        return
    from megatron_wedlm.data.indexed import is_indexed_prefix, tokenizer_manifest
    from megatron_wedlm.data.manifest import (
        MANIFEST_FILE, read_manifest, read_task_manifest, tokenization_difference, tokenization_of,
    )

    if not (Path(valid) / MANIFEST_FILE).is_file() and not is_indexed_prefix(valid):
        return

    def manifest_of(path: str, key: str | None) -> dict[str, Any]:
        if is_indexed_prefix(path):  # a pretraining source (_check_indexed_sources) of data.tokenizer's ids
            return tokenizer_manifest(cfg.data.tokenizer)  # type: ignore[arg-type]
        return read_task_manifest(path, cfg.trainer.task, key) if key else read_manifest(path)

    try:
        valid_manifest = manifest_of(valid, "data.valid_path")
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from None
    try:
        train_manifest = manifest_of(train, None)  # type: ignore[arg-type]
    except (OSError, ValueError):
        return  # data.path itself is checked (and refused) where the run reads it
    difference = tokenization_difference(tokenization_of(valid, valid_manifest),
                                         tokenization_of(train, train_manifest))  # type: ignore[arg-type]
    if difference:
        raise ConfigError(
            f"data.valid_path={valid} was prepared with another tokenizer or mask token than data.path={train} "
            f"({difference}); prepare both with the same --tokenizer and --mask-token (tools/prepare_data.py "
            "--valid-fraction splits one input into both; a Megatron indexed dataset is read with data.tokenizer)"
        )
