"""The run's training data: the prepared directory's manifest and this rank's resumable micro-batches.

Both engines read their data here, so rows, masks and positions are the same under either
backend and a run can be compared or resumed across them.
"""

from __future__ import annotations

from typing import Any

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.data.prepare import read_manifest
from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest

__all__ = ["build_train_data", "read_run_manifest"]


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
        # AR SFT decodes left to right and stops at the first end token: no slot past it to train
        num_learnable_end_tokens=cfg.wedlm.num_learnable_end_tokens if cfg.wedlm.enabled else 0,
    )
    data_state = state.get("data") if cfg.checkpointing.load_data_state else None
    return TrainDataIterator(
        spec, dp_rank, dp_size, cfg.data.micro_batch_size, num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor, state=data_state,
        allow_data_change=cfg.checkpointing.allow_data_change,
    )
