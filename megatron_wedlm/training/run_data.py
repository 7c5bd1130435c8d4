"""The run's training data: the prepared directory's manifest and this rank's resumable micro-batches.

Both engines read their data here, so rows, masks and positions are the same under either
backend and a run can be compared or resumed across them.
"""

from __future__ import annotations

from typing import Any

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.data.prepare import read_manifest
from megatron_wedlm.data.validation_rows import VALIDATION_SEED, ValidationRows, validation_rows
from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest

__all__ = ["build_train_data", "build_valid_data", "read_run_manifest"]


def read_run_manifest(cfg: TrainConfig) -> dict[str, Any]:
    """The manifest of ``data.path``, refused when it was prepared for the other task."""
    manifest = read_manifest(cfg.data.path)  # type: ignore[arg-type]
    if manifest["task"] != cfg.trainer.task:
        raise ConfigError(
            f"data.path={cfg.data.path} holds '{manifest['task']}' data but this is a {cfg.trainer.task} run; "
            f"prepare it with tools/prepare_data.py --task {cfg.trainer.task}"
        )
    return manifest


def build_train_data(cfg: TrainConfig, state: dict[str, Any], dp_rank: int, dp_size: int) -> TrainDataIterator:
    """This data-parallel rank's resumable micro-batch iterator, from the checkpoint's data
    position in ``state`` when ``checkpointing.load_data_state``."""
    spec = loader_spec_from_manifest(
        cfg.data.path,  # type: ignore[arg-type]
        num_streams=cfg.data.num_streams,
        seq_length=cfg.data.seq_length,
        wedlm=cfg.wedlm.enabled,
        block_size=cfg.wedlm.block_size,
        mask_token_id=cfg.wedlm.mask_token_id,
        ratio_mode=cfg.wedlm.ratio_mode,
        random_block_offset=cfg.wedlm.random_block_offset,
        mask_eps=cfg.wedlm.mask_eps,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
        task=cfg.trainer.task,
    )
    data_state = state.get("data") if cfg.checkpointing.load_data_state else None
    return TrainDataIterator(
        spec, dp_rank, dp_size, cfg.data.micro_batch_size, num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor, state=data_state,
        allow_data_change=cfg.checkpointing.allow_data_change,
    )


def build_valid_data(cfg: TrainConfig, dp_rank: int, dp_size: int) -> ValidationRows | None:
    """This data-parallel rank's validation micro-batches (:mod:`megatron_wedlm.data.validation_rows`:
    the first ``trainer.eval_iters x data.global_batch_size`` rows of ``data.valid_path``, rows and
    masks fixed by a seed of their own); None without ``data.valid_path``."""
    path = cfg.data.valid_path
    if path is None:
        return None
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.valid_path: {err}") from None
    if manifest["task"] != cfg.trainer.task:
        raise ConfigError(
            f"data.valid_path={path} holds '{manifest['task']}' data but this is a {cfg.trainer.task} run; "
            f"prepare it with tools/prepare_data.py --task {cfg.trainer.task}"
        )
    spec = loader_spec_from_manifest(
        path,
        num_streams=1,
        seq_length=cfg.data.seq_length,
        wedlm=cfg.wedlm.enabled,
        block_size=cfg.wedlm.block_size,
        mask_token_id=cfg.wedlm.mask_token_id,
        ratio_mode=cfg.wedlm.ratio_mode,
        random_block_offset=cfg.wedlm.random_block_offset,
        mask_eps=cfg.wedlm.mask_eps,
        seed=VALIDATION_SEED,
        shuffle=True,
        task=cfg.trainer.task,
    )
    rows = cfg.trainer.eval_iters * cfg.data.global_batch_size
    return validation_rows(spec, rows, dp_rank, dp_size, cfg.data.micro_batch_size)
