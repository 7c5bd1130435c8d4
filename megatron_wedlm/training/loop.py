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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_wedlm.config.loading import config_to_yaml, save_config
from megatron_wedlm.config.schema import ConfigError, TrainConfig, validate_layout

__all__ = ["TrainResult", "NonFiniteLossError", "agreed", "bf16_enabled", "run_training"]

T = TypeVar("T")


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


def _global_stats(local: list[float], device: torch.device) -> list[float]:
    """Sum a small float vector over all ranks (each slot has one contributor or is a count)."""
    tensor = torch.tensor(local, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def agreed(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, the same answer everywhere (nodes may list a shared directory
    differently for a moment, e.g. NFS attribute caching)."""
    value = [compute() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(value, src=0)
    return value[0]


def run_training(cfg: TrainConfig) -> TrainResult:
    """Train as described by ``cfg`` in this process (one rank of a torchrun launch)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_wedlm.data.prepare import read_manifest
    from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest, merge_data_states
    from megatron_wedlm.model.hf_config import MODEL_ARGS_FILE
    from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports
    from megatron_wedlm.runtime.parallel import ParallelConfig, init_distributed, initialize_parallel_state, resolve_device

    from .checkpointing import CheckpointManager, resolve_resume_path
    from .metrics import MetricsLogger
    from .model_setup import build_model_chunk, load_init_weights, resolve_model_args
    from .optimization import build_optimizer, build_scheduler, current_lr, wrap_ddp
    from .steps import logged_loss, make_forward_step

    # ---- layout, data description, model description (all validated before heavy work) ----
    device = resolve_device(cfg.trainer.device)
    bf16 = bf16_enabled(cfg, device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = validate_layout(cfg, world)
    manifest = read_manifest(cfg.data.path)
    if manifest["task"] != cfg.trainer.task:
        raise ConfigError(
            f"data.path={cfg.data.path} holds '{manifest['task']}' data but this is a {cfg.trainer.task} run; "
            f"prepare it with tools/prepare_data.py --task {cfg.trainer.task}"
        )
    model_args = resolve_model_args(cfg, manifest, "bfloat16" if bf16 else "float32")
    if cfg.wedlm.mask_token_id is None:
        cfg.wedlm.mask_token_id = int(manifest["mask_token_id"])
    cfg.parallelism.dp = dp
    init_distributed(device, timeout_s=cfg.trainer.distributed_timeout_s)
    layout = initialize_parallel_state(
        ParallelConfig(
            tensor_model_parallel_size=cfg.parallelism.tp,
            pipeline_model_parallel_size=cfg.parallelism.pp,
            sequence_parallel=cfg.parallelism.sequence_parallel,
        ),
        device=device.type,
        seed=cfg.trainer.seed,
    )
    is_logger = layout.rank == 0
    output_dir = Path(cfg.trainer.output_dir)
    ckpt_root = Path(cfg.checkpointing.dir or output_dir / "checkpoints")
    cfg.checkpointing.dir = str(ckpt_root)
    resume_path = agreed(lambda: resolve_resume_path(cfg.checkpointing.resume, ckpt_root))

    # ---- model, optimizer, schedule, state ----
    model = build_model_chunk(cfg, model_args, device, torch.bfloat16 if bf16 else torch.float32)
    if cfg.model.init_from is not None and resume_path is None:
        load_init_weights(model, cfg.model.init_from)
    ddp = wrap_ddp(model, cfg)
    optimizer = build_optimizer(cfg, ddp, bf16)
    scheduler = build_scheduler(cfg, optimizer)
    manager = CheckpointManager(ckpt_root, cfg.checkpointing.keep_last)
    state: dict[str, Any] = {}
    if resume_path is not None:
        state = manager.load(resume_path, model, optimizer, cfg.checkpointing.load_optimizer)
        scheduler.load_state_dict(state["scheduler"])
    start_step = int(state.get("step", 0))

    # ---- data ----
    micro_batch = cfg.data.micro_batch_size
    num_microbatches = cfg.data.global_batch_size // (micro_batch * dp)
    spec = loader_spec_from_manifest(
        cfg.data.path,
        num_streams=cfg.data.num_streams,
        seq_length=cfg.data.seq_length,
        wedlm=cfg.wedlm.enabled,
        block_size=cfg.wedlm.block_size,
        mask_token_id=cfg.wedlm.mask_token_id,
        ratio_mode=cfg.wedlm.ratio_mode,
        mask_eps=cfg.wedlm.mask_eps,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
        task=cfg.trainer.task,
    )
    data_state = state.get("data") if cfg.checkpointing.load_data_state else None
    data = TrainDataIterator(
        spec, layout.dp_rank, dp, micro_batch, num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor, state=data_state,
    )

    # ---- bookkeeping ----
    config_yaml = config_to_yaml(cfg)
    if is_logger:
        save_config(cfg, output_dir / "config.yaml")
    from omegaconf import OmegaConf

    logger = MetricsLogger(
        cfg, OmegaConf.to_container(OmegaConf.create(config_yaml)), start_step, is_logger,  # type: ignore[arg-type]
        wandb_run_id=state.get("wandb_run_id"),
    )
    result = TrainResult(final_step=start_step, start_step=start_step, output_dir=str(output_dir))
    consumed_tokens = int(state.get("consumed_tokens", 0))
    skipped_total = int(state.get("skipped_steps", 0))
    nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
    end_step = cfg.trainer.exit_at_step or cfg.trainer.train_steps
    if resume_path is not None:
        logger.message(f"resumed from {resume_path} at step {start_step}")
    logger.message(
        f"{cfg.trainer.task}: {'WeDLM' if cfg.wedlm.enabled else 'AR'} training, world {world} = "
        f"tp {cfg.parallelism.tp} x pp {cfg.parallelism.pp} x dp {dp}, {num_microbatches} micro-batches of "
        f"{micro_batch} x {cfg.data.seq_length}, steps {start_step + 1}..{end_step}, device {device.type}, "
        f"{'bf16' if bf16 else 'fp32'}"
    )

    def save(step: int) -> None:
        data_states: list[Any] = [None] * world
        local = data.state_dict()
        if dist.is_initialized() and world > 1:
            dist.all_gather_object(data_states, local)
        else:
            data_states = [local]
        trainer_state = {
            "scheduler": scheduler.state_dict(),
            "data": merge_data_states(data_states),
            "consumed_tokens": consumed_tokens,
            "skipped_steps": skipped_total,
            "nonfinite_in_a_row": nonfinite_in_a_row,
            "wandb_run_id": logger.wandb_run_id,
            "train_steps": cfg.trainer.train_steps,
        }
        path = manager.save(
            step, model, optimizer, trainer_state,
            files={"config.yaml": config_yaml, MODEL_ARGS_FILE: _model_args_json(model_args)},
        )
        result.checkpoints.append(str(path))
        logger.message(f"saved checkpoint {path}")

    forward_backward = get_forward_backward_func()
    is_stats_rank = ps.is_pipeline_last_stage() and layout.tp_rank == 0 and layout.dp_rank == 0
    counts_tokens = layout.tp_rank == 0 and layout.pp_rank == 0
    result.wandb_run_dir = logger.wandb_run_dir
    step = start_step
    try:
        for step in range(start_step + 1, end_step + 1):
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
            loss, mlm, ar, masked, ar_tokens, tokens, bad_grads = _global_stats(stats, device)
            finite = math.isfinite(loss) and math.isfinite(mlm) and math.isfinite(ar) and bad_grads == 0
            grad_norm = float("nan")
            lr = current_lr(optimizer)  # the lr this update uses
            if finite:
                updated, grad_norm_value, _ = optimizer.step()
                grad_norm = float(grad_norm_value) if grad_norm_value is not None else float("nan")
                if updated:
                    scheduler.step(increment=1)
                nonfinite_in_a_row = 0
            else:
                optimizer.zero_grad()
                skipped_total += 1
                nonfinite_in_a_row += 1
                result.skipped_steps.append(step)
                logger.message(
                    f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient'} "
                    f"(loss={loss}), update skipped ({nonfinite_in_a_row} in a row)"
                )
            consumed_tokens += int(tokens)
            elapsed = time.perf_counter() - started
            record = {
                "step": step,
                "loss": loss,
                "mlm_loss": mlm,
                "ar_loss": ar,
                "masked_tokens": int(masked),
                "ar_tokens": int(ar_tokens),
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_sec": tokens / elapsed if elapsed > 0 else 0.0,
                "tokens": int(tokens),
                "consumed_tokens": consumed_tokens,
                "step_time_s": elapsed,
                "skipped": not finite,
            }
            result.losses[step] = loss
            result.final_step = step
            logger.log_step(record)
            if nonfinite_in_a_row >= cfg.trainer.max_consecutive_nonfinite:
                raise NonFiniteLossError(
                    f"{nonfinite_in_a_row} consecutive steps (last: {step}) had a non-finite loss or gradient; "
                    "stopping. Lower optimizer.lr, check the data, or resume from an earlier checkpoint"
                )
            interval = cfg.checkpointing.save_interval
            last = step == end_step
            if (interval and step % interval == 0) or (last and cfg.checkpointing.save_at_end):
                save(step)
    finally:
        logger.close()
    return result


def _model_args_json(model_args) -> str:
    import json

    return json.dumps(model_args.to_dict(), indent=2, sort_keys=True) + "\n"


def result_dict(result: TrainResult) -> dict[str, Any]:
    return asdict(result)
