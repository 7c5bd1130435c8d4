"""The training loop shared by pretraining and SFT (``trainer.task`` only selects the data kind).

One step: fetch ``num_microbatches`` micro-batches, compute the global loss denominators, run
Megatron's ``get_forward_backward_func`` schedule (pipeline-aware), check loss and gradients
for non-finite values on every rank, step Megatron's optimizer (gradient clipping inside) and
the lr schedule, log, save. A non-finite step is skipped (no update, no schedule step), logged,
and after ``trainer.max_consecutive_nonfinite`` in a row the run stops with an error.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_wedlm.config.schema import ConfigError, TrainConfig, validate_layout

from .step_record import NonFiniteLossError, TrainResult, result_dict, sum_over_ranks

if TYPE_CHECKING:
    from .run_dir import RunClaim

__all__ = ["TrainResult", "NonFiniteLossError", "agreed", "bf16_enabled", "result_dict", "run_training"]

T = TypeVar("T")


def bf16_enabled(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether ``trainer.precision`` means bf16 on ``device`` (both backends resolve it here)."""
    if cfg.trainer.precision == "auto":
        return device.type == "cuda"
    if cfg.trainer.precision == "bf16" and device.type != "cuda":
        raise ConfigError("trainer.precision=bf16 needs a GPU; use fp32 (or auto) on CPU")
    return cfg.trainer.precision == "bf16"


def _grads_nonfinite(ddp_model) -> bool:
    """Any non-finite value in this rank's gradient buffers (after the DP reduction)."""
    buffers = list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))
    for buffer in buffers:
        if not torch.isfinite(buffer.grad_data).all():
            return True
    return False


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


def run_training(cfg: TrainConfig) -> TrainResult:
    """Train as described by ``cfg`` in this process (one rank of a torchrun launch)."""
    from megatron_wedlm.runtime.parallel import ParallelConfig, init_distributed, initialize_parallel_state, resolve_device

    from .model_setup import resolve_model_args
    from .run_dir import claim_output_dir
    from .step_record import read_run_manifest

    # ---- layout, data description, model description (all validated before heavy work) ----
    device = resolve_device(cfg.trainer.device)
    bf16 = bf16_enabled(cfg, device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = validate_layout(cfg, world)
    if cfg.parallelism.virtual_pp is not None:
        raise ConfigError("parallelism.virtual_pp is not run by the training loop yet; remove it")
    manifest = read_run_manifest(cfg)
    model_args = resolve_model_args(cfg, manifest, "bfloat16" if bf16 else "float32")
    if cfg.wedlm.mask_token_id is None:
        cfg.wedlm.mask_token_id = int(manifest["mask_token_id"])
    cfg.parallelism.dp = dp
    init_distributed(device, timeout_s=cfg.trainer.distributed_timeout_s)
    layout = initialize_parallel_state(
        ParallelConfig(
            tensor_model_parallel_size=cfg.parallelism.tp,
            pipeline_model_parallel_size=cfg.parallelism.pp,
            context_parallel_size=cfg.parallelism.cp,
            sequence_parallel=cfg.parallelism.sequence_parallel,
        ),
        device=device.type,
        seed=cfg.trainer.seed,
    )
    is_logger = layout.rank == 0
    claim = claim_output_dir(cfg)  # the lock, the resume decision, the lineage
    try:
        return _train(cfg, claim, device, bf16, world, dp, model_args, layout, is_logger)
    finally:
        claim.release()


def _train(cfg: TrainConfig, claim: RunClaim, device: torch.device, bf16: bool, world: int, dp: int, model_args, layout,
           is_logger: bool) -> TrainResult:
    """The run proper, once ``claim`` owns the output directory."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_wedlm.model.hf_config import MODEL_ARGS_FILE
    from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports

    from .checkpointing import CheckpointManager
    from .model_setup import build_model_chunk, load_init_weights
    from .optimization import build_optimizer, build_scheduler, current_lr, wrap_ddp
    from .step_record import StepRecorder, build_train_data
    from .steps import logged_loss, make_forward_step

    # ---- model, optimizer, schedule, state ----
    model = build_model_chunk(cfg, model_args, device, torch.bfloat16 if bf16 else torch.float32)
    if cfg.model.init_from is not None and claim.resume_path is None:
        load_init_weights(model, cfg.model.init_from)
    ddp = wrap_ddp(model, cfg)
    optimizer = build_optimizer(cfg, ddp, bf16)
    scheduler = build_scheduler(cfg, optimizer)
    manager = CheckpointManager(cfg.checkpointing.dir, cfg.checkpointing.keep_last)
    state: dict[str, Any] = {}
    if claim.resume_path is not None:
        state = manager.load(claim.resume_path, model, optimizer, cfg.checkpointing.load_optimizer)
        scheduler.load_state_dict(state["scheduler"])
    start_step = int(state.get("step", 0))

    # ---- data, log, counters ----
    micro_batch = cfg.data.micro_batch_size
    num_microbatches = cfg.data.global_batch_size // (micro_batch * dp)
    data = build_train_data(cfg, state, layout.dp_rank, dp)
    recorder = StepRecorder(cfg, state, is_logger, claim)
    logger, result = recorder.logger, recorder.result
    logger.message(
        f"{cfg.trainer.task}: {'WeDLM' if cfg.wedlm.enabled else 'AR'} training, world {world} = "
        f"tp {cfg.parallelism.tp} x pp {cfg.parallelism.pp} x cp {cfg.parallelism.cp} x dp {dp}, {num_microbatches} micro-batches of "
        f"{micro_batch} x {cfg.data.seq_length}, steps {start_step + 1}..{recorder.end_step}, device {device.type}, "
        f"{'bf16' if bf16 else 'fp32'}"
    )

    def save(step: int) -> None:
        path = manager.save(
            step, model, optimizer, recorder.trainer_state(scheduler, data),
            files={"config.yaml": recorder.config_yaml, MODEL_ARGS_FILE: _model_args_json(model_args)},
        )
        recorder.saved(path)

    forward_backward = get_forward_backward_func()
    # the CP ranks of a replica share its rows (and the reports are already summed over DP x CP)
    first_cp = ps.get_context_parallel_rank() == 0
    is_stats_rank = ps.is_pipeline_last_stage() and layout.tp_rank == 0 and layout.dp_rank == 0 and first_cp
    counts_tokens = layout.tp_rank == 0 and layout.pp_rank == 0 and first_cp
    try:
        for step in recorder.steps():
            started = time.perf_counter()
            micro = [data.next_microbatch() for _ in range(num_microbatches)]
            batches = [b for b, _ in micro]
            local_tokens = sum(n for _, n in micro)
            normalizer = global_loss_normalizer(batches, cfg.wedlm.loss_weighting)  # type: ignore[arg-type]
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            reports = forward_backward(
                forward_step_func=make_forward_step(cfg, normalizer, num_microbatches, device),
                data_iterator=iter(batches),
                model=[ddp],
                num_microbatches=num_microbatches,
                seq_length=cfg.data.seq_length,
                micro_batch_size=micro_batch,
                forward_only=False,
            )
            summary = reduce_loss_reports(reports, cfg.wedlm.ar_weight) if ps.is_pipeline_last_stage() else None
            stats = [0.0] * 7
            if is_stats_rank and summary is not None:
                stats[:5] = [logged_loss(cfg, summary), summary.mlm, summary.ar, summary.mlm_tokens, summary.ar_tokens]
            if counts_tokens:
                stats[5] = float(local_tokens)
            stats[6] = 1.0 if _grads_nonfinite(ddp) else 0.0
            loss, mlm, ar, masked, ar_tokens, tokens, bad_grads = sum_over_ranks(stats, device)
            finite = math.isfinite(loss) and math.isfinite(mlm) and math.isfinite(ar) and bad_grads == 0
            grad_norm = float("nan")
            lr = current_lr(optimizer)  # the lr this update uses
            if finite:
                updated, grad_norm_value, _ = optimizer.step()
                grad_norm = float(grad_norm_value) if grad_norm_value is not None else float("nan")
                if updated:
                    scheduler.step(increment=1)
            else:
                optimizer.zero_grad()
            due = recorder.record(
                step, started=started, finite=finite, loss=loss, mlm=mlm, ar=ar, masked_tokens=masked,
                ar_tokens=ar_tokens, lr=lr, grad_norm=grad_norm, tokens=tokens,
            )
            if due:
                save(step)
    finally:
        recorder.close()
    return result


def _model_args_json(model_args) -> str:
    import json

    return json.dumps(model_args.to_dict(), indent=2, sort_keys=True) + "\n"

