"""``run_deepspeed_sft``: WeDLM SFT of a HF checkpoint under DeepSpeed ZeRO, one rank of a torchrun launch.

It shares with the Megatron path everything that is not the model engine: the config schema,
the prepared webdataset shards and their resumable loader, the dual-stream rows, the loss
(:func:`megatron_wedlm.model.losses.wedlm_loss` with global denominators), Megatron's lr
schedule (``OptimizerParamScheduler`` driving the ZeRO optimizer's param groups), the
checkpoint directory conventions and ``metrics.jsonl`` / wandb / progress logging. So a run
here and a Megatron run with the same config log the same quantities and follow the same
schedule.

One optimizer step:

1. ``G = global_batch / (micro_batch * world)`` micro-batches from the loader;
2. global loss denominators (MLM weight sum, AR token count) all-reduced over ranks;
3. per micro-batch: forward (per-slot cross entropy), contribution to the global loss,
   ``engine.backward(contribution * G * world)`` -- DeepSpeed divides by ``G`` and averages
   gradients over ranks, so the applied gradient is that of the global loss -- and
   ``engine.step()`` (DeepSpeed clips and updates at the accumulation boundary);
4. a step whose gradient norm is not finite is skipped by DeepSpeed (``was_step_applied``);
   the lr schedule advances only on applied steps, and too many skipped steps in a row stop
   the run, as on the Megatron path.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_wedlm.config.schema import ConfigError, TrainConfig

from .settings import validate_deepspeed_run

if TYPE_CHECKING:
    from megatron_wedlm.training.run_dir import RunClaim

__all__ = ["run_deepspeed_sft", "FINAL_EXPORT_DIR"]

FINAL_EXPORT_DIR = "hf"  # <trainer.output_dir>/hf: the HF export at the end of training
FLEX_TILE_SIZE = 128  # FlexAttention BlockMask tile; rows are padded to whole tiles


def _prepare_deepspeed(device: torch.device) -> None:
    """DeepSpeed picks its accelerator at import: make it the CPU one for CPU runs."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


class _ZeRO3Init:
    """Keeps transformers' ZeRO-3 hook alive while the model is loaded (parameters partitioned at load)."""

    def __init__(self, ds_config: dict[str, Any], enabled: bool) -> None:
        self.handle = None
        if not enabled:
            return
        try:
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            self.handle = HfDeepSpeedConfig(ds_config)
        except ImportError as err:
            raise ConfigError(
                f"deepspeed.zero3_init=true needs the `accelerate` package ({err}); install it "
                "(pip install accelerate) or set deepspeed.zero3_init=false to load the full model on every rank"
            ) from None

    def close(self) -> None:
        if self.handle is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self.handle = None


def _build_model(cfg: TrainConfig, manifest: dict[str, Any], ds_config: dict[str, Any], dtype: torch.dtype,
                 backend: str, zero3_init: bool):
    from .forward import ATTN_IMPLEMENTATION, DualStreamCausalLM
    from .hf_model import apply_mask_token, load_hf_causal_lm, plan_mask_token

    init = _ZeRO3Init(ds_config, zero3_init)
    try:
        hf_model = load_hf_causal_lm(cfg.model.init_from, dtype, ATTN_IMPLEMENTATION[backend])  # type: ignore[arg-type]
        rows = hf_model.get_input_embeddings().num_embeddings
        plan = plan_mask_token(cfg.model.init_from, int(cfg.wedlm.mask_token_id), rows)  # type: ignore[arg-type]
        apply_mask_token(hf_model, plan, cfg.model.make_vocab_size_divisible_by)
    finally:
        init.close()
    rows = hf_model.get_input_embeddings().num_embeddings
    if rows < int(manifest["tokenizer_length"]):
        raise ConfigError(
            f"the model in model.init_from has {rows} embedding rows but the data's tokenizer has "
            f"{manifest['tokenizer_length']} tokens; prepare the data with the checkpoint's tokenizer"
        )
    positions = cfg.data.seq_length // 2 if cfg.wedlm.enabled else cfg.data.seq_length
    max_positions = getattr(hf_model.config, "max_position_embeddings", None)
    if max_positions is not None and positions > max_positions:
        raise ConfigError(
            f"rows of data.seq_length={cfg.data.seq_length} hold positions up to {positions}, beyond the "
            f"checkpoint's max_position_embeddings={max_positions}"
        )
    if cfg.parallelism.recompute != "none":
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf_model, DualStreamCausalLM(hf_model)


def _build_optimizer(cfg: TrainConfig, module, device: torch.device, offload: bool):
    """AdamW over Megatron-style weight-decay groups; DeepSpeed's CPU Adam when states are offloaded."""
    from .hf_model import weight_decay_param_groups

    o = cfg.optimizer
    groups = weight_decay_param_groups(module, o.weight_decay)
    kwargs = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=device.type == "cuda", **kwargs)


def run_deepspeed_sft(cfg: TrainConfig):
    """Train as ``cfg`` says in this process; returns the Megatron path's ``TrainResult``."""
    from megatron_wedlm.runtime.parallel import init_distributed, resolve_device
    from megatron_wedlm.training.loop import bf16_enabled
    from megatron_wedlm.training.model_setup import resolve_attention_backend
    from megatron_wedlm.training.run_dir import claim_output_dir
    from megatron_wedlm.training.step_record import read_run_manifest

    from .settings import build_ds_config

    validate_deepspeed_run(cfg)
    device = resolve_device(cfg.trainer.device)
    bf16 = bf16_enabled(cfg, device)
    dtype = torch.bfloat16 if bf16 else torch.float32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    manifest = read_run_manifest(cfg)
    if cfg.wedlm.mask_token_id is None:
        cfg.wedlm.mask_token_id = int(manifest["mask_token_id"])
    ds_config = build_ds_config(cfg, world, bf16)
    num_microbatches = int(ds_config["gradient_accumulation_steps"])
    backend = resolve_attention_backend(cfg.model.attention_backend, device)
    cfg.parallelism.dp = world

    _prepare_deepspeed(device)
    init_distributed(device, timeout_s=cfg.trainer.distributed_timeout_s)
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    rank = dist.get_rank()
    torch.manual_seed(cfg.trainer.seed)

    claim = claim_output_dir(cfg)  # the lock, the resume decision, the lineage (as on the Megatron path)
    try:
        return _train(cfg, claim, manifest, ds_config, num_microbatches, backend, device, bf16, dtype, world, rank)
    finally:
        claim.release()


def _train(cfg: TrainConfig, claim: RunClaim, manifest: dict[str, Any], ds_config: dict[str, Any],
           num_microbatches: int, backend: str, device: torch.device, bf16: bool, dtype: torch.dtype, world: int,
           rank: int):
    """The run proper, once ``claim`` owns the output directory."""
    import deepspeed

    from megatron_wedlm.data.prepare import TOKENIZER_DIR
    from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports
    from megatron_wedlm.training.optimization import build_scheduler, current_lr
    from megatron_wedlm.training.step_record import StepRecorder, build_train_data, sum_over_ranks

    from .checkpoint import DeepSpeedCheckpointManager, export_hf_model
    from .forward import model_inputs, pad_to_tiles, training_objective

    ds = cfg.deepspeed
    is_logger = rank == 0
    output_dir = Path(cfg.trainer.output_dir)
    resume_path = claim.resume_path

    # ---- model, engine, schedule, state ----
    zero3_init = ds.zero_stage == 3 and ds.zero3_init
    hf_model, module = _build_model(cfg, manifest, ds_config, dtype, backend, zero3_init)
    optimizer = _build_optimizer(cfg, module, device, offload=ds.offload_optimizer != "none")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
    scheduler = build_scheduler(cfg, engine.optimizer)
    manager = DeepSpeedCheckpointManager(cfg.checkpointing.dir, cfg.checkpointing.keep_last)
    state: dict[str, Any] = {}
    if resume_path is not None:
        state = manager.load(resume_path, engine, cfg.checkpointing.load_optimizer)
        scheduler.load_state_dict(state["scheduler"])
    start_step = int(state.get("step", 0))

    # ---- data (the Megatron path's loader: same rows, masks and resume positions), log, counters ----
    micro_batch = cfg.data.micro_batch_size
    data = build_train_data(cfg, state, rank, world)
    tokenizer_dir = Path(cfg.data.path) / manifest.get("tokenizer", TOKENIZER_DIR)  # type: ignore[arg-type]
    recorder = StepRecorder(cfg, state, is_logger, claim)
    logger, result = recorder.logger, recorder.result
    offload = [k for k, v in (("optimizer", ds.offload_optimizer), ("params", ds.offload_params)) if v != "none"]
    logger.message(
        f"{cfg.trainer.task} (DeepSpeed ZeRO-{ds.zero_stage}{', offload ' + '+'.join(offload) if offload else ''}): "
        f"{'WeDLM' if cfg.wedlm.enabled else 'AR'} training of {cfg.model.init_from}, world {world}, "
        f"{num_microbatches} micro-batches of {micro_batch} x {cfg.data.seq_length}, steps {start_step + 1}.."
        f"{recorder.end_step}, device {device.type}, {'bf16' if bf16 else 'fp32'}, attention {backend}"
    )

    def export(directory: Path) -> None:
        export_hf_model(engine, hf_model, directory, tokenizer_dir)

    def save(step: int) -> None:
        trainer_state = {**recorder.trainer_state(scheduler, data), "init_from": cfg.model.init_from}
        path = manager.save(step, engine, trainer_state, {"config.yaml": recorder.config_yaml},
                            export=export if ds.export_hf else None)
        recorder.saved(path)

    group = dist.group.WORLD if world > 1 else None
    try:
        for step in recorder.steps():
            started = time.perf_counter()
            micro = [data.next_microbatch() for _ in range(num_microbatches)]
            batches = [b for b, _ in micro]
            weighting = cfg.wedlm.loss_weighting
            normalizer = global_loss_normalizer(batches, weighting, group=group)  # type: ignore[arg-type]
            lr = current_lr(engine.optimizer)  # the lr this update uses
            reports = []
            for batch in batches:
                batch = batch.to(device)
                if backend == "flex":
                    batch = pad_to_tiles(batch, FLEX_TILE_SIZE)
                per_slot = engine(*model_inputs(batch, backend, dtype, FLEX_TILE_SIZE))
                objective, loss = training_objective(
                    per_slot, batch, normalizer, wedlm=cfg.wedlm.enabled,
                    ar_weight=cfg.wedlm.ar_weight, mlm_weighting=cfg.wedlm.loss_weighting,  # type: ignore[arg-type]
                )
                engine.backward(objective * (num_microbatches * world))
                engine.step()
                reports.append(loss.report())
            summary = reduce_loss_reports(reports, cfg.wedlm.ar_weight, group=group)
            loss_value = float(summary.total) if cfg.wedlm.enabled else float(summary.ar)
            applied = bool(engine.was_step_applied())
            (tokens,) = sum_over_ranks([float(sum(n for _, n in micro))], device)
            finite = applied and math.isfinite(loss_value)
            grad_norm = float("nan")
            if finite:
                norm = engine.get_global_grad_norm()
                grad_norm = float(norm) if norm is not None else float("nan")
                scheduler.step(increment=1)
            due = recorder.record(
                step, started=started, finite=finite, loss=loss_value, mlm=summary.mlm, ar=summary.ar,
                masked_tokens=summary.mlm_tokens, ar_tokens=summary.ar_tokens, lr=lr, grad_norm=grad_norm,
                tokens=tokens,
            )
            if due:
                save(step)
        if result.final_step == cfg.trainer.train_steps:
            final = export_hf_model(engine, hf_model, output_dir / FINAL_EXPORT_DIR, tokenizer_dir)
            logger.message(f"exported the trained model to {final}")
    finally:
        recorder.close()
    return result

