"""The one training loop: ``run_training(cfg, engine)`` for both engines and both objectives.

The loop owns everything a run does that is not the model engine: the device and precision,
the data description, the output directory (lock, resume decision, lineage), the lr schedule,
the resumable data, the log, the non-finite policy and the save schedule. An engine
(:class:`~.megatron_engine.MegatronEngine`, or
:class:`megatron_wedlm.deepspeed_backend.engine.DeepSpeedEngine`; the contract is
:class:`~.engine.Engine`) builds the model and optimizer, runs forward and backward over the
step's micro-batches, applies or drops the update as the loop decides, and saves or loads its
tensors. The objective (:class:`~.objective.Objective`, WeDLM or AR) says what is
differentiated and logged.

One step: fetch ``num_microbatches`` micro-batches, compute the global loss denominators, let
the engine compute gradients, sum the step's losses, token counts and gradient health over the
ranks (one all-reduce), have the engine apply the update only when everything is finite,
advance the lr schedule on applied updates, validate when due (:mod:`.validation`), log (losses,
throughput: :mod:`.throughput`), save. A non-finite step is skipped (weights and optimizer state
untouched), logged, and after ``trainer.max_consecutive_nonfinite`` in a row the run stops with
:class:`NonFiniteLossError`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports
from megatron_wedlm.runtime.parallel import resolve_device
from megatron_wedlm.runtime.precision import native_bf16_reason

from .engine import Engine, RankRole, StepUpdate
from .megatron_engine import MegatronEngine
from .objective import Objective
from .optimization import build_scheduler, current_lr
from .run_data import build_train_data, build_valid_data, read_run_manifest
from .run_dir import RunClaim, claim_output_dir
from .step_record import NonFiniteLossError, StepRecorder, StepTotals, TrainResult, result_dict
from .stop_signal import StopSignal
from .throughput import batch_flops, default_peak_tflops, max_over_ranks, peak_memory_gib
from .validation import Validator

__all__ = ["Engine", "NonFiniteLossError", "RankRole", "StepUpdate", "TrainResult", "bf16_enabled", "result_dict",
           "run_training"]


def bf16_enabled(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether ``trainer.precision`` means bf16 on ``device``: ``auto`` is bf16 on a GPU and fp32
    on a CPU; an explicit ``bf16`` holds on either (on a CPU it pays only with native bf16 matrix
    instructions, :mod:`megatron_wedlm.runtime.precision`; the run's first line says which)."""
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


def run_training(cfg: TrainConfig, engine: Engine | None = None) -> TrainResult:
    """Train as described by ``cfg`` in this process (one rank of a torchrun launch) with
    ``engine`` (default: Megatron-Core)."""
    if engine is None:
        engine = MegatronEngine(cfg)
    device = resolve_device(cfg.trainer.device)
    bf16 = bf16_enabled(cfg, device)
    manifest = read_run_manifest(cfg)
    if cfg.wedlm.mask_token_id is None:
        cfg.wedlm.mask_token_id = int(manifest["mask_token_id"])
    role = engine.start(device, bf16, manifest)  # checks, process groups
    claim = claim_output_dir(cfg)  # the lock, the resume decision, the lineage
    try:
        return _train(cfg, engine, role, claim, device, bf16)
    finally:
        claim.release()


def _train(cfg: TrainConfig, engine: Engine, role: RankRole, claim: RunClaim, device: torch.device,
           bf16: bool) -> TrainResult:
    """The run proper, once ``claim`` owns the output directory."""
    objective = Objective.from_config(cfg)
    optimizer = engine.build(resuming=claim.resume_path is not None)
    scheduler = build_scheduler(cfg, optimizer)
    state: dict = {}
    if claim.resume_path is not None:
        state = engine.load(claim.resume_path)
        scheduler.load_state_dict(state["scheduler"])

    shape = engine.model_shape()
    micro_batch = cfg.data.micro_batch_size
    num_microbatches = cfg.data.global_batch_size // (micro_batch * role.dp_size)
    data = build_train_data(cfg, state, role.dp_rank, role.dp_size)
    recorder = StepRecorder(cfg, state, role.is_logger, claim,
                            peak_tflops=cfg.logging.peak_tflops or default_peak_tflops(device, bf16))
    logger, result = recorder.logger, recorder.result
    world = dist.get_world_size() if dist.is_initialized() else 1
    logger.message(
        f"{cfg.trainer.task}: {objective.name} training ({engine.describe()}), world {world}, "
        f"{num_microbatches} micro-batches of {micro_batch} x {cfg.data.seq_length}, "
        f"steps {recorder.start_step + 1}..{recorder.end_step}, device {device.type}, {precision_name(bf16, device)}"
    )
    valid_rows = build_valid_data(cfg, role.dp_rank, role.dp_size)
    validator = None
    if valid_rows is not None:
        validator = Validator(cfg, valid_rows, objective, role, device, recorder.end_step)
        logger.message(validator.describe())
    else:
        logger.message("no validation: data.valid_path is unset (tools/prepare_data.py --valid-fraction writes "
                       "<data.path>/valid, which data.valid_path=auto reads)")

    stop = StopSignal(cfg.trainer.exit_signal)  # blocked by the entry point, asked after each step
    try:
        for step in recorder.steps():
            started = time.perf_counter()
            micro = [data.next_microbatch() for _ in range(num_microbatches)]
            fed = time.perf_counter()  # the step waited this long for its rows
            batches = [b for b, _ in micro]
            normalizer = global_loss_normalizer(batches, objective.mlm_weighting, group=role.loss_group)
            lr = current_lr(optimizer)  # the lr this update uses
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
                                   for name, n in data.take_source_tokens().items()}
            local.ranks_with_bad_grads = 0.0 if engine.grads_finite() else 1.0
            local.stop_requests = stop.requested
            totals = local.summed_over_ranks(device)  # every rank learns here whether one was signalled
            stopping = totals.stop_requests > 0 and step < recorder.end_step  # the last step ends as usual
            update = engine.optimizer_step(apply=totals.finite)
            if update.applied:
                scheduler.step(increment=1)
            # the slowest rank's data wait holds every rank up
            peak_memory, data_wait = max_over_ranks([peak_memory_gib(device), fed - started], device)
            trained = time.perf_counter()
            valid = validator.run(engine) if validator is not None and validator.due(step) and not stopping else None
            due = recorder.record(step, started=started, totals=totals, lr=lr, grad_norm=update.grad_norm,
                                  ended=trained, valid=valid, peak_memory_gib=peak_memory, data_wait_s=data_wait)
            if due or stopping:
                trainer_state = recorder.trainer_state(scheduler, data)
                recorder.saved(engine.save(step, trainer_state, {"config.yaml": recorder.config_yaml}))
            if stopping:
                recorder.stopped(step, cfg.trainer.exit_signal)
                break
        if result.final_step == cfg.trainer.train_steps:
            engine.finish(logger)
    finally:
        recorder.close()
    return result
