"""What happens around a training step whatever the engine: both engines log the same
``metrics.jsonl`` records, stop on non-finite steps, save and resume the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from omegaconf import OmegaConf

from megatron_wedlm.config.loading import config_to_yaml, save_config
from megatron_wedlm.config.schema import TrainConfig

from .metrics import MetricsLogger

if TYPE_CHECKING:
    from .run_dir import RunClaim

__all__ = [
    "NonFiniteLossError",
    "StepRecorder",
    "TrainResult",
    "StepTotals",
    "result_dict",
]


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class TrainResult:
    final_step: int
    start_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> logged loss (all steps run)
    # step -> {"loss", "mlm_loss", "ar_loss"} of the validations this run made
    valid_losses: dict[int, dict[str, float]] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    wandb_run_dir: str | None = None
    output_dir: str = ""
    stopped_by: str | None = None  # the signal that stopped the run before its last step


def result_dict(result: TrainResult) -> dict[str, Any]:
    return asdict(result)


@dataclass
class StepTotals:
    """A step's logged numbers, summed over the ranks in one all-reduce, each counted once."""

    loss: float = 0.0
    mlm: float = 0.0
    ar: float = 0.0
    masked_tokens: float = 0.0
    ar_tokens: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0  # model FLOPs of the step (forward + backward; see .throughput)
    ranks_with_bad_grads: float = 0.0
    stop_requests: float = 0.0  # ranks that got trainer.exit_signal (.stop_signal)
    # tokens per data.blend source name (empty for one source); every rank lists the same names
    source_tokens: dict[str, float] = field(default_factory=dict)
    # MoE router losses (moe_aux_loss, moe_z_loss): already reduced, the same on every rank, not summed
    router: dict[str, float] = field(default_factory=dict)

    def summed_over_ranks(self, device: torch.device) -> StepTotals:
        names = [f.name for f in fields(self) if f.name not in ("source_tokens", "router")]
        sources = sorted(self.source_tokens)
        values = [getattr(self, name) for name in names] + [self.source_tokens[k] for k in sources]
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tensor)
        summed = tensor.cpu().tolist()
        return StepTotals(**dict(zip(names, summed)), source_tokens=dict(zip(sources, summed[len(names):])),
                          router=dict(self.router))

    @property
    def finite(self) -> bool:
        """Whether the step may be applied: finite losses and finite gradients on every rank."""
        return math.isfinite(self.loss) and math.isfinite(self.mlm) and math.isfinite(self.ar) \
            and self.ranks_with_bad_grads == 0


class StepRecorder:
    """The run's counters, log and result from the resumed ``state`` on: records each step, stops
    on too many non-finite steps in a row, decides when to save and what the trainer state holds."""

    def __init__(self, cfg: TrainConfig, state: dict[str, Any], is_logger: bool, claim: RunClaim,
                 peak_tflops: float | None = None) -> None:
        self.cfg = cfg
        self.peak_tflops = peak_tflops  # per device, for MFU (None: MFU not reported)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
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
        self.consumed_source_tokens = {k: int(v) for k, v in state.get("consumed_source_tokens", {}).items()}
        self.skipped_total = int(state.get("skipped_steps", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        if claim.resume_path is not None:
            self.logger.message(f"resumed from {claim.resume_path} at step {self.start_step} (run {claim.run_id})")

    def steps(self) -> range:
        return range(self.start_step + 1, self.end_step + 1)

    def record(self, step: int, *, started: float, totals: StepTotals, lr: float, grad_norm: float,
               ended: float | None = None, valid: dict[str, Any] | None = None,
               peak_memory_gib: float = float("nan"), data_wait_s: float = 0.0) -> bool:
        """Log step ``step`` (begun at ``started``, trained by ``ended``, default now; applied when
        ``totals.finite``; ``peak_memory_gib`` and ``data_wait_s``: the largest over the ranks) with the
        ``valid/*`` numbers of a validation after it; raise :class:`NonFiniteLossError` on too many skips
        in a row. Returns whether a checkpoint is due now."""
        finite, loss, tokens = totals.finite, totals.loss, totals.tokens
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
        for name, count in totals.source_tokens.items():
            self.consumed_source_tokens[name] = self.consumed_source_tokens.get(name, 0) + int(count)
        elapsed = (time.perf_counter() if ended is None else ended) - started
        if valid is not None:
            self.result.valid_losses[step] = {k: float(valid[f"valid/{k}"]) for k in ("loss", "mlm_loss", "ar_loss")}
            self.logger.message(
                f"step {step}: validation loss {valid['valid/loss']:.4f} (mlm {valid['valid/mlm_loss']:.4f}, "
                f"ar {valid['valid/ar_loss']:.4f}; {valid['valid/tokens']} tokens, {valid['valid/time_s']:.2f} s)"
            )
        self.logger.log_step({
            "step": step,
            "loss": loss,
            "mlm_loss": totals.mlm,
            "ar_loss": totals.ar,
            **totals.router,
            "masked_tokens": int(totals.masked_tokens),
            "ar_tokens": int(totals.ar_tokens),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens / elapsed if elapsed > 0 else 0.0,
            **self._throughput(totals, elapsed, peak_memory_gib),
            "tokens": int(tokens),
            "consumed_tokens": self.consumed_tokens,
            "step_time_s": elapsed,
            "data_wait_s": data_wait_s,
            "data_wait_fraction": data_wait_s / elapsed if elapsed > 0 else 0.0,
            "skipped": not finite,
            "run_id": self.claim.run_id,
            **{f"tokens/{name}": int(count) for name, count in totals.source_tokens.items()},
            **(valid or {}),
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

    def _throughput(self, totals: StepTotals, elapsed: float, peak_memory_gib: float) -> dict[str, Any]:
        """Megatron-LM's per-device figures: tokens/s, model TFLOP/s, MFU (None without a peak)."""
        per_device = elapsed * self.world if elapsed > 0 else float("inf")
        tflops = totals.flops / per_device / 1e12
        return {
            "tokens_per_sec_per_device": totals.tokens / per_device,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "step_flops": totals.flops,
            "peak_memory_gib": peak_memory_gib,
        }

    def trainer_state(self, scheduler, data) -> dict[str, Any]:
        """Collective (gathers every rank's data position): the checkpoint's non-tensor state."""
        local = data.state_dict()
        world = dist.get_world_size() if dist.is_initialized() else 1
        data_states: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(data_states, local)
        else:
            data_states = [local]
        return {
            "scheduler": scheduler.state_dict(),
            "data": data.merge_states(data_states),
            "consumed_tokens": self.consumed_tokens,
            "consumed_source_tokens": self.consumed_source_tokens,
            "skipped_steps": self.skipped_total,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "wandb_run_id": self.logger.wandb_run_id,
            "train_steps": self.cfg.trainer.train_steps,
            **self.claim.checkpoint_fields(),
        }

    def saved(self, path: Path) -> None:
        self.result.checkpoints.append(str(path))
        self.logger.message(f"saved checkpoint {path}")

    def stopped(self, step: int, signal_name: str) -> None:
        """The run stops after ``step`` (just saved) because a rank got ``signal_name``."""
        self.result.stopped_by = signal_name
        self.logger.message(
            f"stopped by {signal_name} after step {step} of {self.end_step}, saved; the same command with "
            "--resume auto continues from this checkpoint"
        )

    def close(self) -> None:
        self.logger.close()
