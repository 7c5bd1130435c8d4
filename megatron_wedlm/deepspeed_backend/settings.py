"""The DeepSpeed backend's checks of a run and the DeepSpeed JSON config derived from it.

Every setting both backends share has one key in the training schema; the ``deepspeed`` section
holds only ZeRO's, and ``extra_config`` (merged last) any DeepSpeed knob nobody mapped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.model.attention_backends import ATTENTION_BACKENDS, backend_names

__all__ = ["build_ds_config", "validate_deepspeed_run"]


def validate_deepspeed_run(cfg: TrainConfig) -> None:
    """Rules of the DeepSpeed backend on top of :func:`validate_config`; ConfigError naming the key."""
    if cfg.trainer.backend != "deepspeed":
        raise ConfigError(f"trainer.backend={cfg.trainer.backend!r}: this is the DeepSpeed backend (set deepspeed)")
    if cfg.trainer.task != "sft":
        raise ConfigError(f"trainer.task={cfg.trainer.task!r}: the DeepSpeed backend fine-tunes (sft) only")
    ds = cfg.deepspeed
    if ds.extra_config is not None and not Path(ds.extra_config).is_file():
        raise ConfigError(f"deepspeed.extra_config={ds.extra_config!r} is not a file")
    if cfg.model.init_from is None:
        raise ConfigError("model.init_from must name a HF model directory for trainer.backend=deepspeed")
    set_arch = [
        f"model.{k}" for k in (
            "architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
            "rms_norm_eps", "qk_layernorm", "add_qkv_bias", "tie_word_embeddings",
        ) if getattr(cfg.model, k) is not None
    ]
    if set_arch:
        raise ConfigError(
            f"{', '.join(set_arch)} cannot be set with trainer.backend=deepspeed: the architecture is the "
            f"HF checkpoint's in model.init_from={cfg.model.init_from}; remove these keys"
        )
    backend = ATTENTION_BACKENDS.get(cfg.model.attention_backend)
    if backend is not None and backend.hf_attn_implementation is None:
        usable = backend_names(lambda b: b.hf_attn_implementation is not None)
        raise ConfigError(
            f"model.attention_backend={backend.name!r} is not available with trainer.backend=deepspeed (HF "
            f"models have no such attention); use {', '.join(usable)}"
        )
    p = cfg.parallelism
    if p.tp != 1 or p.pp != 1 or p.sequence_parallel:
        raise ConfigError(
            f"parallelism.tp={p.tp}, pp={p.pp}, sequence_parallel={p.sequence_parallel}: the DeepSpeed backend "
            "is data-parallel only (ZeRO shards states instead); set tp=1, pp=1, sequence_parallel=false"
        )
    if cfg.optimizer.name != "adam":
        raise ConfigError(f"optimizer.name={cfg.optimizer.name!r}: the DeepSpeed backend trains with adam (AdamW)")


def build_ds_config(cfg: TrainConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed JSON config of a run, without optimizer and lr schedule: the trainer builds
    AdamW groups and drives the lr with Megatron's scheduler, one schedule for both backends."""
    ds = cfg.deepspeed
    micro = cfg.data.micro_batch_size
    if cfg.data.global_batch_size % (micro * world_size):
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not a multiple of "
            f"data.micro_batch_size x world size = {micro} x {world_size}"
        )
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer, "pin_memory": False}
    if ds.offload_params != "none":
        zero["offload_param"] = {"device": ds.offload_params, "pin_memory": False}
    config: dict[str, Any] = {
        "train_batch_size": cfg.data.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": cfg.data.global_batch_size // (micro * world_size),
        "gradient_clipping": float(cfg.optimizer.clip_grad),
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16), "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,  # progress goes through the run's own logger
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if ds.extra_config is not None:
        config = _deep_merge(config, json.loads(Path(ds.extra_config).read_text()))
    return config


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
