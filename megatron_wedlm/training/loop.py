"""The one training loop: ``run_training(cfg, engine_type)`` for both engines and both objectives.

The loop owns the run (device, precision, data, output directory, lr schedule, log, non-finite
policy, saves); an engine (:mod:`.engine`) owns the model and computes gradients, and the loop
decides whether a step is applied: one non-finite on any rank is skipped, weights untouched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_wedlm.config.data_check import check_data_files
from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.data.row_format import RowFormat
from megatron_wedlm.data.webdataset_loader import DataIterator
from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports
from megatron_wedlm.runtime.parallel import resolve_device
from megatron_wedlm.runtime.precision import native_bf16_reason

from .engine import Engine, EnginePlan, EngineType, RankRole, StepUpdate
from .megatron_engine import MegatronEngine
from .objective import Objective
from .optimization import build_scheduler, current_lr
from .run_data import build_train_data, build_valid_data, read_run_manifest, run_row_format
from .run_dir import RunClaim, claim_output_dir
from .step_record import NonFiniteLossError, StepRecorder, StepTotals, TrainResult, result_dict
from .stop_signal import StopSignal
from .throughput import ModelShape, batch_flops, default_peak_tflops, max_over_ranks, peak_memory_gib
from .validation import Validator

__all__ = ["Engine", "EngineType", "NonFiniteLossError", "RankRole", "StepUpdate", "TrainResult", "bf16_enabled",
           "result_dict", "run_config", "run_training"]


def bf16_enabled(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether ``trainer.precision`` means bf16 on ``device``: ``auto`` is bf16 on a GPU and fp32
    on a CPU; an explicit ``bf16`` holds on either (:mod:`megatron_wedlm.runtime.precision`)."""
    if cfg.trainer.precision == "auto":
        return device.type == "cuda"
    if cfg.trainer.precision == "bf16" and cfg.trainer.backend == "deepspeed" and device.type != "cuda":
        raise ConfigError("trainer.precision=bf16 on CPU is supported by the Megatron engine "
                          "(trainer.backend=megatron); use fp32 with trainer.backend=deepspeed on CPU")
    return cfg.trainer.precision == "bf16"


def precision_name(bf16: bool, device: torch.device) -> str:
    """The precision as the run's first line states it; bf16 on a CPU says whether it is native."""
    if not bf16:
        return "fp32"
    if device.type != "cpu":
        return "bf16"
    reason = native_bf16_reason(device)
    return f"bf16 (native: {reason})" if reason else "bf16 (not native on this CPU: expect it slower than fp32)"


def run_training(cfg: TrainConfig, engine_type: EngineType = MegatronEngine) -> TrainResult:
    """Train as ``cfg`` says in this process (one rank of a torchrun launch) with an engine of ``engine_type``."""
    check_data_files(cfg)  # the entry points check earlier too; a caller of this function gets the same refusals
    device = resolve_device(cfg.trainer.device)
    bf16 = bf16_enabled(cfg, device)
    manifest = read_run_manifest(cfg)
    row_format = run_row_format(cfg, manifest)  # refuses a configured mask id that is not the data's
    plan = engine_type.start(cfg, device, bf16, manifest)  # checks, process groups
    claim = claim_output_dir(cfg)  # the lock, the resume decision, the lineage
    try:
        run, recorder = _start_run(cfg, engine_type, plan, claim, device, bf16, row_format)
        return _run_steps(run, recorder)
    finally:
        claim.release()


def run_config(cfg: TrainConfig, plan: EnginePlan, claim: RunClaim, row_format: RowFormat) -> TrainConfig:
    """The run's config as ``config.yaml`` records it: ``cfg`` with what the run derived (the engine's
    model keys, the layout's data-parallel size, the checkpoint root, the data's mask token id).
    A copy: ``cfg`` stays as given."""
    cfg = plan.resolve(cfg)
    return replace(cfg, parallelism=replace(cfg.parallelism, dp=plan.role.dp_size),
                   checkpointing=replace(cfg.checkpointing, dir=str(claim.checkpoint_root)),
                   wedlm=replace(cfg.wedlm, mask_token_id=row_format.mask_token_id))


@dataclass
class _Run:
    """What the steps of one run share, built once the output directory is claimed."""

    cfg: TrainConfig
    engine: Engine
    role: RankRole
    objective: Objective
    device: torch.device
    scheduler: Any  # the lr schedule (Megatron's OptimizerParamScheduler)
    data: DataIterator
    validator: Validator | None
    num_microbatches: int


def _start_run(cfg: TrainConfig, engine_type: EngineType, plan: EnginePlan, claim: RunClaim, device: torch.device,
               bf16: bool, row_format: RowFormat) -> tuple[_Run, StepRecorder]:
    """Build the engine, schedule, data, log and validation of the run ``claim`` owns; resume their state."""
    role = plan.role
    cfg = run_config(cfg, plan, claim, row_format)
    objective = Objective.from_config(cfg)
    engine = engine_type(cfg, plan, resuming=claim.resume_path is not None)
    scheduler = build_scheduler(cfg, engine.optimizer)
    state: dict = {}
    if claim.resume_path is not None:
        state = engine.load(claim.resume_path)
        scheduler.load_state_dict(state["scheduler"])
    num_microbatches = cfg.data.global_batch_size // (cfg.data.micro_batch_size * role.dp_size)
    data = build_train_data(cfg, row_format, state, role.dp_rank, role.dp_size)
    recorder = StepRecorder(cfg, state, role.is_logger, claim,
                            peak_tflops=cfg.logging.peak_tflops or default_peak_tflops(device, bf16))
    world = dist.get_world_size() if dist.is_initialized() else 1
    recorder.logger.message(
        f"{cfg.trainer.task}: {objective.name} training ({engine.describe()}), world {world}, "
        f"{num_microbatches} micro-batches of {cfg.data.micro_batch_size} x {cfg.data.seq_length}, "
        f"steps {recorder.start_step + 1}..{recorder.end_step}, device {device.type}, {precision_name(bf16, device)}"
    )
    valid_rows = build_valid_data(cfg, row_format, role.dp_rank, role.dp_size)
    validator = None
    if valid_rows is not None:
        validator = Validator(cfg, valid_rows, objective, role, device, recorder.end_step)
        recorder.logger.message(validator.describe())
    else:
        recorder.logger.message("no validation: data.valid_path is unset (tools/prepare_data.py --valid-fraction "
                                "writes <data.path>/valid, which data.valid_path=auto reads)")
    return _Run(cfg, engine, role, objective, device, scheduler, data, validator, num_microbatches), recorder


def _run_steps(run: _Run, recorder: StepRecorder) -> TrainResult:
    """The steps: data, step, log, checkpoint, stop (on a signal, on the last step)."""
    cfg, engine, device = run.cfg, run.engine, run.device
    shape = engine.model_shape()
    stop = StopSignal(cfg.trainer.exit_signal)  # blocked by the entry point, asked after each step
    try:
        for step in recorder.steps():
            started = time.perf_counter()
            micro = [run.data.next_microbatch() for _ in range(run.num_microbatches)]
            fed = time.perf_counter()  # the step waited this long for its rows
            lr = current_lr(engine.optimizer)  # the lr this update uses
            totals, update = _train_step(run, micro, shape, stop)
            stopping = totals.stop_requests > 0 and step < recorder.end_step  # the last step ends as usual
            # the slowest rank's data wait holds every rank up
            peak_memory, data_wait = max_over_ranks([peak_memory_gib(device), fed - started], device)
            trained = time.perf_counter()
            due_valid = run.validator is not None and run.validator.due(step) and not stopping
            valid = run.validator.run(engine) if due_valid else None  # type: ignore[union-attr]
            due = recorder.record(step, started=started, totals=totals, lr=lr, grad_norm=update.grad_norm,
                                  ended=trained, valid=valid, peak_memory_gib=peak_memory, data_wait_s=data_wait)
            if due or stopping:
                trainer_state = recorder.trainer_state(run.scheduler, run.data)
                recorder.saved(engine.save(step, trainer_state, {"config.yaml": recorder.config_yaml}))
            if stopping:
                recorder.stopped(step, cfg.trainer.exit_signal)
                break
        if recorder.result.final_step == cfg.trainer.train_steps:
            engine.finish(recorder.logger)
    finally:
        recorder.close()
        run.data.close()
    return recorder.result


def _train_step(run: _Run, micro: list, shape: ModelShape, stop: StopSignal) -> tuple[StepTotals, StepUpdate]:
    """One step: gradients, the step's totals summed over the ranks, the update when everything is
    finite (the lr schedule advances with it)."""
    engine, role, objective = run.engine, run.role, run.objective
    batches = [b for b, _ in micro]
    normalizer = global_loss_normalizer(batches, objective.mlm_weighting, group=role.loss_group)
    reports = engine.forward_backward(batches, normalizer, objective)
    local = StepTotals()
    if reports is not None:
        summary = reduce_loss_reports(reports, objective.ar_weight, group=role.loss_group)
        if role.reports_losses:
            local.loss, local.mlm, local.ar = objective.logged_loss(summary), summary.mlm, summary.ar
            local.masked_tokens, local.ar_tokens = summary.mlm_tokens, summary.ar_tokens
    if role.counts_tokens:
        local.tokens = float(sum(n for _, n in micro))
        local.flops = batch_flops(shape, batches)
    local.source_tokens = {name: float(n) if role.counts_tokens else 0.0  # every rank sends every name
                           for name, n in run.data.take_source_tokens().items()}
    local.router = engine.router_losses
    local.ranks_with_bad_grads = 0.0 if engine.grads_finite() else 1.0
    local.stop_requests = stop.requested
    totals = local.summed_over_ranks(run.device)
    update = engine.optimizer_step(apply=totals.finite)
    if update.applied:
        run.scheduler.step(increment=1)
    return totals, update
