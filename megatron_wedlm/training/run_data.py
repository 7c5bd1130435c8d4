"""The run's training data: the sources' manifests and this rank's resumable micro-batches.

Both engines read their data here, so rows, masks and positions are the same under either
backend and a run can be compared or resumed across them. ``data.path`` is one source;
``data.blend`` mixes several by weight (:mod:`megatron_wedlm.data.blend`), and the model is then
described by the first source's manifest and tokenizer (all sources must share them). A source is
a prepared directory or a Megatron indexed dataset's prefix, read with ``data.tokenizer``
(:mod:`megatron_wedlm.data.indexed`, checked here, before training starts).
"""

from __future__ import annotations

from typing import Any

from megatron_wedlm.config.schema import ConfigError, TrainConfig, indexed_options, training_data_dir
from megatron_wedlm.data.blend import BlendedDataIterator, BlendSource, blend_names, check_compatible_sources
from megatron_wedlm.data.indexed import read_source_manifest, read_source_task_manifest
from megatron_wedlm.data.validation_rows import VALIDATION_SEED, ValidationRows, validation_rows
from megatron_wedlm.data.row_format import RowFormat
from megatron_wedlm.data.webdataset_loader import (
    DataIterator,
    LoaderSpec,
    TrainDataIterator,
    loader_spec_from_manifest,
    manifest_row_format,
)

__all__ = ["build_train_data", "build_valid_data", "read_run_manifest", "run_data_dir", "run_row_format"]


def run_data_dir(cfg: TrainConfig) -> str:
    """The source (directory or indexed prefix) whose manifest and tokenizer describe the run
    (required by the config check)."""
    return training_data_dir(cfg)  # type: ignore[return-value]


def _blend_names(cfg: TrainConfig) -> list[str]:
    try:
        return blend_names([s.path for s in cfg.data.blend], [s.name for s in cfg.data.blend])  # type: ignore[union-attr, misc]
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _task_manifest(cfg: TrainConfig, key: str, path: str) -> dict[str, Any]:
    """The manifest of the source ``path`` (config key ``key``), refused when missing, prepared for
    the other task or (a prefix) failing its checks."""
    try:
        return read_source_task_manifest(path, cfg.trainer.task, key, **indexed_options(cfg.data))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _source_manifest(cfg: TrainConfig, key: str, path: str) -> dict[str, Any]:
    """The manifest of the source ``path`` (config key ``key``), whatever its task (a blend
    compares the sources' tasks itself)."""
    try:
        return read_source_manifest(path, **indexed_options(cfg.data))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {err}") from None


def read_run_manifest(cfg: TrainConfig) -> dict[str, Any]:
    """The manifest of ``data.path`` (of the first ``data.blend`` source, the others checked to
    match it), refused when it was prepared for the other task."""
    key = "data.path" if cfg.data.blend is None else "data.blend[0].path"
    manifest = _task_manifest(cfg, key, run_data_dir(cfg))
    if cfg.data.blend is not None:
        names = _blend_names(cfg)
        sources = [(name, s.path, manifest if i == 0 else _source_manifest(cfg, f"data.blend[{i}].path", s.path))
                   for i, (name, s) in enumerate(zip(names, cfg.data.blend))]  # type: ignore[arg-type]
        try:
            check_compatible_sources(sources)  # type: ignore[arg-type]
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return manifest


def run_row_format(cfg: TrainConfig, manifest: dict[str, Any]) -> RowFormat:
    """The run's row format: the ``wedlm`` section's settings and the token ids of the run's data
    (``manifest``, :func:`read_run_manifest`), which every source shares; a ``wedlm.mask_token_id``
    given in the config must be the data's."""
    wedlm, data_dir = cfg.wedlm, run_data_dir(cfg)
    recorded = int(manifest["mask_token_id"])
    if wedlm.mask_token_id is not None and wedlm.mask_token_id != recorded:
        raise ValueError(
            f"wedlm.mask_token_id={wedlm.mask_token_id} differs from the mask token id {recorded} of the data in "
            f"{data_dir}; remove the override or re-prepare the data"
        )
    return manifest_row_format(
        data_dir, manifest, block_size=wedlm.block_size, ratio_mode=wedlm.ratio_mode,
        random_block_offset=wedlm.random_block_offset, mask_eps=wedlm.mask_eps,
        # AR SFT decodes left to right and stops at the first end token: no slot past it to train
        num_learnable_end_tokens=wedlm.num_learnable_end_tokens if wedlm.enabled else 0,
        mask_after_masked_end=wedlm.mask_after_masked_end if wedlm.enabled else 0.0,
        prune_unmasked_blocks=wedlm.prune_unmasked_blocks,
    )


def _loader_spec(cfg: TrainConfig, data_dir: str, row_format: RowFormat, num_streams: int | None = None,
                 seed: int | None = None, shuffle: bool | None = None) -> LoaderSpec:
    """How rows of ``data_dir`` are built for this run (the data section's streams, seed and
    shuffling unless given: validation reads one stream of its own)."""
    try:
        return loader_spec_from_manifest(
            data_dir,
            row_format,
            manifest=read_source_manifest(data_dir, **indexed_options(cfg.data)),
            num_streams=cfg.data.num_streams if num_streams is None else num_streams,
            seq_length=cfg.data.seq_length,
            wedlm=cfg.wedlm.enabled,
            seed=cfg.data.seed if seed is None else seed,
            shuffle=cfg.data.shuffle if shuffle is None else shuffle,
            task=cfg.trainer.task,
        )
    except ValueError as err:
        if cfg.data.blend is None or data_dir == cfg.data.valid_path:
            raise
        raise ValueError(f"data.blend source {data_dir}: {err}") from None


def build_train_data(
    cfg: TrainConfig, row_format: RowFormat, state: dict[str, Any], dp_rank: int, dp_size: int
) -> DataIterator:
    """This data-parallel rank's resumable micro-batch iterator, from the checkpoint's data
    position in ``state`` when ``checkpointing.load_data_state``."""
    data_state = state.get("data") if cfg.checkpointing.load_data_state else None
    options = dict(num_workers=cfg.data.num_workers, prefetch_factor=cfg.data.prefetch_factor, state=data_state,
                   allow_data_change=cfg.checkpointing.allow_data_change)
    if cfg.data.blend is None:
        return TrainDataIterator(_loader_spec(cfg, cfg.data.path, row_format), dp_rank, dp_size,  # type: ignore[arg-type]
                                 cfg.data.micro_batch_size, **options)  # type: ignore[arg-type]
    sources = [BlendSource(name, _loader_spec(cfg, s.path, row_format), s.weight)  # type: ignore[arg-type]
               for name, s in zip(_blend_names(cfg), cfg.data.blend)]
    return BlendedDataIterator(sources, dp_rank, dp_size, cfg.data.micro_batch_size, **options)  # type: ignore[arg-type]


def build_valid_data(cfg: TrainConfig, row_format: RowFormat, dp_rank: int, dp_size: int) -> ValidationRows | None:
    """This data-parallel rank's validation micro-batches (:mod:`megatron_wedlm.data.validation_rows`:
    the first ``trainer.eval_iters x data.global_batch_size`` rows of ``data.valid_path``, built as
    training rows are, but read as one stream whose rows and masks follow a seed of their own);
    None without ``data.valid_path``."""
    path = cfg.data.valid_path
    if path is None:
        return None
    _task_manifest(cfg, "data.valid_path", path)
    spec = _loader_spec(cfg, path, row_format, num_streams=1, seed=VALIDATION_SEED, shuffle=True)
    rows = cfg.trainer.eval_iters * cfg.data.global_batch_size
    return validation_rows(spec, rows, dp_rank, dp_size, cfg.data.micro_batch_size)
