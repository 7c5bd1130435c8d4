"""What happens around a training step that does not depend on the model engine.

The one loop (:mod:`.loop`) uses these with either engine, so both read the same prepared
data, log the same ``metrics.jsonl`` records, count and stop on non-finite steps the same way,
save on the same schedule and resume from the same trainer-state keys.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_wedlm.config.schema import ConfigError, TrainConfig

if TYPE_CHECKING:
    from .run_dir import RunClaim

__all__ = [
    "NonFiniteLossError",
    "StepRecorder",
    "TrainResult",
    "build_train_data",
    "read_run_manifest",
    "result_dict",
    "sum_over_ranks",
]


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class TrainResult:
    final_step: int
    start_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> logged loss (all steps run)
    skipped_steps: list[int] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    wandb_run_dir: str | None = None
    output_dir: str = ""


def result_dict(result: TrainResult) -> dict[str, Any]:
    return asdict(result)


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Sum a small float vector over all ranks (one all-reduce for every number a step logs)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def read_run_manifest(cfg: TrainConfig) -> dict[str, Any]:
    """The manifest of ``data.path``, refused when it was prepared for the other task."""
    from megatron_wedlm.data.prepare import read_manifest

    manifest = read_manifest(cfg.data.path)  # type: ignore[arg-type]
    if manifest["task"] != cfg.trainer.task:
        raise ConfigError(
            f"data.path={cfg.data.path} holds '{manifest['task']}' data but this is a {cfg.trainer.task} run; "
            f"prepare it with tools/prepare_data.py --task {cfg.trainer.task}"
        )
    return manifest


def build_train_data(cfg: TrainConfig, state: dict[str, Any], dp_rank: int, dp_size: int):
    """This data-parallel rank's resumable micro-batch iterator (rows, masks and positions are
    the same under either backend, so a run can be compared or resumed across them)."""
    from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest

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


class StepRecorder:
    """The run's counters, log and result from the resumed ``state`` on: records each step,
    stops after too many non-finite steps in a row, decides when to save and what the
    checkpoint's trainer state holds besides the engine's tensors."""

    def __init__(self, cfg: TrainConfig, state: dict[str, Any], is_logger: bool, claim: RunClaim) -> None:
        from omegaconf import OmegaConf

        from megatron_wedlm.config.loading import config_to_yaml, save_config

        from .metrics import MetricsLogger

        self.cfg = cfg
        self.claim = claim
        self.output_dir = Path(cfg.trainer.output_dir)
        self.start_step = int(state.get("step", 0))
        self.end_step = cfg.trainer.exit_at_step or cfg.trainer.train_steps
        self.config_yaml = config_to_yaml(cfg)
        if is_logger:
            save_config(cfg, self.output_dir / "config.yaml")
        self.logger = MetricsLogger(
            cfg, OmegaConf.to_container(OmegaConf.create(self.config_yaml)), self.start_step, is_logger,  # type: ignore[arg-type]
            wandb_run_id=state.get("wandb_run_id"), run_id=claim.run_id, lineage=claim.lineage,
        )
        self.result = TrainResult(final_step=self.start_step, start_step=self.start_step,
                                  output_dir=str(self.output_dir))
        self.result.wandb_run_dir = self.logger.wandb_run_dir
        self.consumed_tokens = int(state.get("consumed_tokens", 0))
        self.skipped_total = int(state.get("skipped_steps", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        if claim.resume_path is not None:
            self.logger.message(f"resumed from {claim.resume_path} at step {self.start_step} (run {claim.run_id})")

    def steps(self) -> range:
        return range(self.start_step + 1, self.end_step + 1)

    def record(
        self,
        step: int,
        *,
        started: float,
        finite: bool,
        loss: float,
        mlm: float,
        ar: float,
        masked_tokens: float,
        ar_tokens: float,
        lr: float,
        grad_norm: float,
        tokens: float,
    ) -> bool:
        """Log step ``step`` (begun at ``time.perf_counter() == started``; ``finite``: its update
        was applied); raise :class:`NonFiniteLossError` on too many skips in a row. Returns
        whether a checkpoint is due now."""
        if finite:
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_total += 1
            self.nonfinite_in_a_row += 1
            self.result.skipped_steps.append(step)
            self.logger.message(
                f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient'} "
                f"(loss={loss}), update skipped ({self.nonfinite_in_a_row} in a row)"
            )
        self.consumed_tokens += int(tokens)
        elapsed = time.perf_counter() - started
        self.logger.log_step({
            "step": step,
            "loss": loss,
            "mlm_loss": mlm,
            "ar_loss": ar,
            "masked_tokens": int(masked_tokens),
            "ar_tokens": int(ar_tokens),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens / elapsed if elapsed > 0 else 0.0,
            "tokens": int(tokens),
            "consumed_tokens": self.consumed_tokens,
            "step_time_s": elapsed,
            "skipped": not finite,
            "run_id": self.claim.run_id,
        })
        self.result.losses[step] = loss
        self.result.final_step = step
        if self.nonfinite_in_a_row >= self.cfg.trainer.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} consecutive steps (last: {step}) had a non-finite loss or gradient; "
                "stopping. Lower optimizer.lr, check the data, or resume from an earlier checkpoint"
            )
        interval = self.cfg.checkpointing.save_interval
        last = step == self.end_step
        return bool((interval and step % interval == 0) or (last and self.cfg.checkpointing.save_at_end))

    def trainer_state(self, scheduler, data) -> dict[str, Any]:
        """Collective (gathers every rank's data position): the checkpoint's non-tensor state."""
        from megatron_wedlm.data.webdataset_loader import merge_data_states

        local = data.state_dict()
        world = dist.get_world_size() if dist.is_initialized() else 1
        data_states: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(data_states, local)
        else:
            data_states = [local]
        return {
            "scheduler": scheduler.state_dict(),
            "data": merge_data_states(data_states),
            "consumed_tokens": self.consumed_tokens,
            "skipped_steps": self.skipped_total,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "wandb_run_id": self.logger.wandb_run_id,
            "train_steps": self.cfg.trainer.train_steps,
            **self.claim.checkpoint_fields(),
        }

    def saved(self, path: Path) -> None:
        self.result.checkpoints.append(str(path))
        self.logger.message(f"saved checkpoint {path}")

    def close(self) -> None:
        self.logger.close()
