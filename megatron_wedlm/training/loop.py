"""The one training loop: ``run_training(cfg, engine)`` for both engines and both objectives.

The loop owns everything a run does that is not the model engine: the device and precision,
the data description, the output directory (lock, resume decision, lineage), the lr schedule,
the resumable data, the log, the non-finite policy and the save schedule. An engine
(:class:`~.megatron_engine.MegatronEngine`, or
:class:`megatron_wedlm.deepspeed_backend.engine.DeepSpeedEngine`) builds the model and
optimizer, runs forward and backward over the step's micro-batches, applies the update and
saves or loads its tensors. The objective (:class:`~.objective.Objective`, WeDLM or AR) says
what is differentiated and logged.

One step: fetch ``num_microbatches`` micro-batches, compute the global loss denominators, let
the engine run forward/backward, sum the step's losses, token counts and gradient health over
the ranks (one all-reduce), apply the update only when everything is finite, advance the lr
schedule on applied updates, log, save. A non-finite step is skipped, logged, and after
``trainer.max_consecutive_nonfinite`` in a row the run stops with :class:`NonFiniteLossError`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.data.dual_stream import DualStreamBatch
from megatron_wedlm.model.losses import LossNormalizer

from .objective import Objective
from .step_record import NonFiniteLossError, TrainResult, result_dict, sum_over_ranks

__all__ = ["Engine", "TrainResult", "NonFiniteLossError", "agreed", "bf16_enabled", "result_dict", "run_training"]

T = TypeVar("T")


class Engine(Protocol):
    """What a model engine provides to :func:`run_training` (set by ``start``: ``dp_rank``,
    ``dp_size``, ``is_logger``; ``reports_losses``: this rank's losses are the step's;
    ``counts_tokens``: this rank's tokens count towards the step's)."""

    loss_group: Any  # the group the loss denominators and reports are summed over
    dp_rank: int
    dp_size: int
    is_logger: bool
    reports_losses: bool
    counts_tokens: bool
    optimizer: Any

    def start(self, device: torch.device, bf16: bool, manifest: dict[str, Any]) -> None: ...
    def describe(self) -> str: ...
    def build(self, resuming: bool) -> None: ...
    def load(self, path: Path) -> dict[str, Any]: ...
    def save(self, step: int, trainer_state: dict[str, Any], files: dict[str, str]) -> Path: ...
    def forward_backward(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                         objective: Objective) -> list[dict[str, Tensor]] | None: ...
    def grads_finite(self) -> bool: ...
    def optimizer_step(self, finite: bool) -> tuple[bool, float]: ...
    def finish(self, logger) -> None: ...


def bf16_enabled(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether ``trainer.precision`` means bf16 on ``device``."""
    if cfg.trainer.precision == "auto":
        return device.type == "cuda"
    if cfg.trainer.precision == "bf16" and device.type != "cuda":
        raise ConfigError("trainer.precision=bf16 needs a GPU; use fp32 (or auto) on CPU")
    return cfg.trainer.precision == "bf16"


def agreed(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, the same answer everywhere (nodes may list a shared directory
    differently for a moment, e.g. NFS attribute caching). When rank 0 raises, every rank
    raises that error (the others would otherwise wait in the broadcast until the timeout)."""
    outcome: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = [(True, compute())]
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            outcome = [(False, err)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def run_training(cfg: TrainConfig, engine: Engine | None = None) -> TrainResult:
    """Train as described by ``cfg`` in this process (one rank of a torchrun launch) with
    ``engine`` (default: Megatron-Core)."""
    from megatron_wedlm.runtime.parallel import resolve_device

    from .run_dir import claim_output_dir
    from .step_record import read_run_manifest

    if engine is None:
        from .megatron_engine import MegatronEngine

        engine = MegatronEngine(cfg)
    device = resolve_device(cfg.trainer.device)
    bf16 = bf16_enabled(cfg, device)
    manifest = read_run_manifest(cfg)
    if cfg.wedlm.mask_token_id is None:
        cfg.wedlm.mask_token_id = int(manifest["mask_token_id"])
    engine.start(device, bf16, manifest)  # checks, process groups
    claim = claim_output_dir(cfg)  # the lock, the resume decision, the lineage
    try:
        return _train(cfg, engine, claim, device, bf16)
    finally:
        claim.release()


def _train(cfg: TrainConfig, engine: Engine, claim, device: torch.device, bf16: bool) -> TrainResult:
    """The run proper, once ``claim`` owns the output directory."""
    from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports

    from .optimization import build_scheduler, current_lr
    from .step_record import StepRecorder, build_train_data

    objective = Objective.from_config(cfg)
    engine.build(resuming=claim.resume_path is not None)
    scheduler = build_scheduler(cfg, engine.optimizer)
    state: dict[str, Any] = {}
    if claim.resume_path is not None:
        state = engine.load(claim.resume_path)
        scheduler.load_state_dict(state["scheduler"])

    micro_batch = cfg.data.micro_batch_size
    num_microbatches = cfg.data.global_batch_size // (micro_batch * engine.dp_size)
    data = build_train_data(cfg, state, engine.dp_rank, engine.dp_size)
    recorder = StepRecorder(cfg, state, engine.is_logger, claim)
    logger, result = recorder.logger, recorder.result
    world = dist.get_world_size() if dist.is_initialized() else 1
    logger.message(
        f"{cfg.trainer.task}: {objective.name} training ({engine.describe()}), world {world}, "
        f"{num_microbatches} micro-batches of {micro_batch} x {cfg.data.seq_length}, "
        f"steps {recorder.start_step + 1}..{recorder.end_step}, device {device.type}, {'bf16' if bf16 else 'fp32'}"
    )

    try:
        for step in recorder.steps():
            started = time.perf_counter()
            micro = [data.next_microbatch() for _ in range(num_microbatches)]
            batches = [b for b, _ in micro]
            normalizer = global_loss_normalizer(batches, objective.mlm_weighting, group=engine.loss_group)
            lr = current_lr(engine.optimizer)  # the lr this update uses
            reports = engine.forward_backward(batches, normalizer, objective)
            stats = [0.0] * 7
            if reports is not None:
                summary = reduce_loss_reports(reports, objective.ar_weight, group=engine.loss_group)
                if engine.reports_losses:
                    stats[:5] = [objective.logged_loss(summary), summary.mlm, summary.ar, summary.mlm_tokens,
                                 summary.ar_tokens]
            if engine.counts_tokens:
                stats[5] = float(sum(n for _, n in micro))
            stats[6] = 0.0 if engine.grads_finite() else 1.0
            loss, mlm, ar, masked, ar_tokens, tokens, bad_grads = sum_over_ranks(stats, device)
            finite = math.isfinite(loss) and math.isfinite(mlm) and math.isfinite(ar) and bad_grads == 0
            updated, grad_norm = engine.optimizer_step(finite)
            if updated:
                scheduler.step(increment=1)
            due = recorder.record(
                step, started=started, finite=finite, loss=loss, mlm=mlm, ar=ar, masked_tokens=masked,
                ar_tokens=ar_tokens, lr=lr, grad_norm=grad_norm, tokens=tokens,
            )
            if due:
                trainer_state = recorder.trainer_state(scheduler, data)
                recorder.saved(engine.save(step, trainer_state, {"config.yaml": recorder.config_yaml}))
        if result.final_step == cfg.trainer.train_steps:
            engine.finish(logger)
    finally:
        recorder.close()
    return result

