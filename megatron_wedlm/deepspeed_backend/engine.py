"""The DeepSpeed ZeRO engine of :func:`megatron_wedlm.training.loop.run_training`: WeDLM SFT of a HF
checkpoint. Per micro-batch ``engine.backward(contribution * G * world)`` (DeepSpeed divides by
``G`` and averages over ranks, so the gradient is the global loss's) and ``engine.step()`` between
micro-batches (counters only). The boundary's ``engine.step()`` is the loop's decision: with the
update when the step is finite on every rank, without it otherwise (:func:`_update_withheld`).
The trained model is exported to ``<trainer.output_dir>/hf`` at the end.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.data.manifest import tokenizer_dir_of
from megatron_wedlm.model.attention_backends import resolve_attention_backend
from megatron_wedlm.model.hf_config import model_args_from_hf_config
from megatron_wedlm.runtime.parallel import init_distributed
from megatron_wedlm.training.engine import RankRole, StepUpdate
from megatron_wedlm.training.loop import run_training
from megatron_wedlm.training.throughput import ModelShape
from megatron_wedlm.training.run_data import run_data_dir

from .checkpoint import DeepSpeedCheckpointManager, export_hf_model
from .forward import DualStreamCausalLM, dual_stream_cross_entropy, hf_attention_backend, pad_rows
from .hf_model import apply_mask_token, load_hf_causal_lm, plan_mask_token, weight_decay_param_groups
from .settings import build_ds_config, validate_deepspeed_run

if TYPE_CHECKING:
    from megatron_wedlm.data.dual_stream import DualStreamBatch
    from megatron_wedlm.model.losses import LossNormalizer
    from megatron_wedlm.training.objective import Objective
    from megatron_wedlm.training.step_record import TrainResult

__all__ = ["DeepSpeedEngine", "DeepSpeedPlan", "FINAL_EXPORT_DIR", "run_deepspeed_sft"]

FINAL_EXPORT_DIR = "hf"  # <trainer.output_dir>/hf: the HF export at the end of training


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
    init = _ZeRO3Init(ds_config, zero3_init)
    try:
        implementation = hf_attention_backend(backend).hf_attn_implementation
        hf_model = load_hf_causal_lm(cfg.model.init_from, dtype, implementation)  # type: ignore[arg-type]
        rows = hf_model.get_input_embeddings().num_embeddings
        plan = plan_mask_token(cfg.model.init_from, int(manifest["mask_token_id"]), rows)  # type: ignore[arg-type]
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
    o = cfg.optimizer
    groups = weight_decay_param_groups(module, o.weight_decay)
    kwargs = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=device.type == "cuda", **kwargs)


@contextmanager
def _update_withheld(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """DeepSpeed's ``step()`` without the weight update: the base optimizer's ``step`` does nothing
    meanwhile, so ZeRO releases the gradients and advances its counters, weights and Adam state kept."""
    optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del optimizer.step  # the class's own step again


def _grads_have_inf_or_nan(ds_engine) -> bool:
    """Collective over the DP group: any inf/NaN in the step's reduced gradients (the ZeRO
    optimizer's own overflow check, partitioned under ZeRO-2/3)."""
    zero = ds_engine.optimizer
    return bool(zero.has_overflow(partition_gradients=getattr(zero, "partition_gradients", True)))


@dataclass(frozen=True)
class DeepSpeedPlan:
    """What :meth:`DeepSpeedEngine.start` derived: role, DeepSpeed config, attention backend."""

    role: RankRole
    device: torch.device
    bf16: bool
    manifest: dict[str, Any]
    ds_config: dict[str, Any]
    backend: str

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    def resolve(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` as it is: the HF checkpoint describes the model."""
        return cfg


class DeepSpeedEngine:
    """A HF causal LM trained by a DeepSpeed ZeRO engine; DeepSpeed checkpoints and HF exports."""

    router_losses: dict[str, float] = {}  # replaced after each MoE step (read-only here)

    def __init__(self, cfg: TrainConfig, plan: DeepSpeedPlan, resuming: bool) -> None:
        """Load the HF model (a resumed checkpoint replaces its weights), build the optimizer and the
        DeepSpeed engine."""
        import deepspeed

        ds = cfg.deepspeed
        self.cfg, self.plan = cfg, plan
        self.device, self.dtype, self.backend, self.world = plan.device, plan.dtype, plan.backend, plan.role.dp_size
        zero3_init = ds.zero_stage == 3 and ds.zero3_init
        self.hf_model, module = _build_model(cfg, plan.manifest, plan.ds_config, self.dtype, self.backend, zero3_init)
        self.base_optimizer = _build_optimizer(cfg, module, self.device, offload=ds.offload_optimizer != "none")
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=self.base_optimizer, config=plan.ds_config)
        self.optimizer = self.engine.optimizer

    @classmethod
    def start(cls, cfg: TrainConfig, device: torch.device, bf16: bool, manifest: dict[str, Any]) -> DeepSpeedPlan:
        """Check the run, derive the DeepSpeed config, create the process group."""
        validate_deepspeed_run(cfg)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        ds_config = build_ds_config(cfg, world, bf16)
        backend = resolve_attention_backend(cfg.model.attention_backend, device)

        _prepare_deepspeed(device)
        init_distributed(device, timeout_s=cfg.trainer.distributed_timeout_s)
        import deepspeed  # only after _prepare_deepspeed (DS_ACCELERATOR)

        deepspeed.init_distributed(dist_backend=dist.get_backend())
        torch.manual_seed(cfg.trainer.seed)
        rank = dist.get_rank()
        # every rank is a data-parallel replica holding the step's summed losses: rank 0 reports them
        role = RankRole(dp_rank=rank, dp_size=world, is_logger=rank == 0, reports_losses=rank == 0,
                        counts_tokens=True, loss_group=dist.group.WORLD if world > 1 else None)
        return DeepSpeedPlan(role, device, bf16, manifest, ds_config, backend)

    def describe(self) -> str:
        ds = self.cfg.deepspeed
        offload = [k for k, v in (("optimizer", ds.offload_optimizer), ("params", ds.offload_params)) if v != "none"]
        return (f"DeepSpeed ZeRO-{ds.zero_stage}{', offload ' + '+'.join(offload) if offload else ''} of "
                f"{self.cfg.model.init_from}, attention {self.backend}")

    # ---- state ----
    def model_shape(self) -> ModelShape:
        """The HF model computes logits over its embedding rows (no Megatron vocabulary padding)."""
        args = model_args_from_hf_config(self.hf_model.config)
        return ModelShape.from_model_args(args, output_rows=args.vocab_size)

    def _manager(self):
        return DeepSpeedCheckpointManager(self.cfg.checkpointing.dir, self.cfg.checkpointing.keep_last)

    def _tokenizer_dir(self) -> Path:
        return tokenizer_dir_of(run_data_dir(self.cfg), self.plan.manifest)

    def _export(self, directory: Path) -> Path:
        return export_hf_model(self.engine, self.hf_model, directory, self._tokenizer_dir())

    def load(self, path: Path) -> dict[str, Any]:
        return self._manager().load(path, self.engine, self.cfg.checkpointing.load_optimizer)

    def save(self, step: int, trainer_state: dict[str, Any], files: dict[str, str]) -> Path:
        trainer_state = {**trainer_state, "init_from": self.cfg.model.init_from}
        return self._manager().save(step, self.engine, trainer_state, files,
                                    export=self._export if self.cfg.deepspeed.export_hf else None)

    # ---- one step ----
    def forward_backward(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                         objective: Objective) -> list[dict[str, torch.Tensor]]:
        """Forward and backward per micro-batch, ``engine.step()`` between them; the loss reports."""
        scale = len(batches) * self.world
        reports = []
        for index, batch in enumerate(batches):
            batch = pad_rows(batch.to(self.device), self.backend)
            per_slot = dual_stream_cross_entropy(self.engine, batch, self.backend, self.dtype)
            contribution, loss = objective.contribution(per_slot, batch, normalizer)
            self.engine.backward(contribution * scale)
            if index < len(batches) - 1:
                self.engine.step()
            reports.append(loss.report())
        return reports

    def grads_finite(self) -> bool:
        return not _grads_have_inf_or_nan(self.engine)

    def optimizer_step(self, apply: bool) -> StepUpdate:
        """The boundary's ``engine.step()``: with the update when ``apply`` (DeepSpeed may still skip on
        overflow), without it otherwise."""
        if not apply:
            with _update_withheld(self.base_optimizer):
                self.engine.step()
            return StepUpdate(applied=False, grad_norm=float("nan"))
        self.engine.step()
        if not self.engine.was_step_applied():
            return StepUpdate(applied=False, grad_norm=float("nan"))
        norm = self.engine.get_global_grad_norm()
        return StepUpdate(applied=True, grad_norm=float(norm) if norm is not None else float("nan"))

    def evaluate(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                 objective: Objective) -> list[dict[str, torch.Tensor]]:
        """Forward per micro-batch without autograd, in eval mode (as HF's Trainer evaluates); the loss
        reports."""
        reports = []
        self.engine.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    batch = pad_rows(batch.to(self.device), self.backend)
                    per_slot = dual_stream_cross_entropy(self.engine, batch, self.backend, self.dtype)
                    _, loss = objective.contribution(per_slot, batch, normalizer)
                    reports.append(loss.report())
        finally:
            self.engine.train()
        return reports

    def finish(self, logger) -> None:
        final = self._export(Path(self.cfg.trainer.output_dir) / FINAL_EXPORT_DIR)
        logger.message(f"exported the trained model to {final}")


def run_deepspeed_sft(cfg: TrainConfig) -> TrainResult:
    """:func:`megatron_wedlm.training.loop.run_training` with the DeepSpeed engine."""
    return run_training(cfg, DeepSpeedEngine)
