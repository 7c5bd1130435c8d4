"""The typed training configuration: one dataclass per section, merged with YAML and CLI overrides.

The schema is the documentation of every key (name, type, default), and ``OmegaConf.structured``
turns it into a config that rejects unknown keys and wrong types as YAML or ``key=value``
overrides are merged, so a typo fails before any process group exists (:mod:`.loading`).
Cross-field rules live in :func:`validate_config`, which names the key in every error and reads
no file; the checks that read the data a config names are :mod:`.data_check`'s.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

# The tables of attention backends and recompute modes (light modules: no torch or Megatron at import).
from megatron_wedlm.model.attention_backends import ATTENTION_BACKEND_NAMES, ATTENTION_BACKENDS, backend_names
from megatron_wedlm.model.moe import LOAD_BALANCING_TYPES
from megatron_wedlm.model.recompute import RECOMPUTE_MODES

__all__ = [
    "BlendSourceConfig",
    "CheckpointingConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "WeDLMConfig",
    "ConfigError",
    "CHOICES",
    "blend_from_data_path",
    "indexed_options",
]


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or an invalid value."""


@dataclass
class ModelConfig:
    """The network. With ``init_from`` set, unset (null) fields are read from the checkpoint's
    ``wedlm_model.json`` (written by ``tools/convert_checkpoint.py hf-to-megatron`` or by a
    training run) and set fields must agree with it. Without it the model is built from scratch
    and ``architecture``, ``num_layers``, ``hidden_size``, ``ffn_hidden_size`` and
    ``num_attention_heads`` are required."""

    init_from: Optional[str] = None
    architecture: Optional[str] = None  # qwen2 | qwen3 | llama | qwen3_moe
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # default: num_attention_heads (no GQA)
    head_dim: Optional[int] = None  # default: hidden_size // num_attention_heads
    vocab_size: Optional[int] = None  # default: the data's tokenizer length
    max_position_embeddings: Optional[int] = None  # default: data.seq_length
    rope_theta: Optional[float] = None  # default: 10000
    rms_norm_eps: Optional[float] = None  # default: 1e-6
    qk_layernorm: Optional[bool] = None  # default: True for qwen3
    add_qkv_bias: Optional[bool] = None  # default: True for qwen2
    tie_word_embeddings: Optional[bool] = None  # default: False
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"  # auto (flex on GPU, dense on CPU) or a name of model/attention_backends.py
    init_method_std: float = 0.02
    # Mixture of experts (architecture qwen3_moe; docs/training.md "MoE"). Architecture:
    num_experts: Optional[int] = None  # experts per layer
    moe_ffn_hidden_size: Optional[int] = None  # each expert's FFN width
    moe_topk: Optional[int] = None  # experts per token
    moe_norm_topk_prob: Optional[bool] = None  # renormalise the top-k weights (default: False)
    # How the routers train:
    moe_aux_loss_coeff: float = 1e-3  # load-balancing loss weight (Qwen3-MoE's router_aux_loss_coef)
    moe_z_loss_coeff: Optional[float] = None  # router z-loss weight; null: none
    moe_load_balancing: str = "aux_loss"  # aux_loss (per micro-batch) | seq_aux_loss (per row) | none
    moe_capacity_factor: Optional[float] = None  # null: dropless; else tokens per expert over the even share
    moe_grouped_gemm: Optional[bool] = None  # one GEMM for a rank's experts; null: on GPU with Transformer Engine


@dataclass
class WeDLMConfig:
    """Dual-stream masking and the loss (docs/method.md §2). ``enabled=false`` trains plain
    next-token prediction on the same packed rows (memory stream only)."""

    enabled: bool = True
    block_size: int = 32
    mask_token_id: Optional[int] = None  # default: the id recorded by tools/prepare_data.py
    ratio_mode: str = "block"  # block | document
    # each document's block grid starts 0..block_size-1 positions early (random), so the clean-context
    # boundary falls at every position as in decoding; false = the grid from position 0 (docs/method.md §2.2)
    random_block_offset: bool = False
    mask_eps: float = 1e-8
    loss_weighting: str = "inverse_ratio"  # inverse_ratio (1/gamma) | uniform
    ar_weight: float = 1.0  # total = (mlm + w * ar) / (1 + w); 0 disables the AR loss
    # SFT with enabled=true: learnt end tokens per reply = its own end token + n-1 copies appended after
    # the rendered sample (the reference finetune's num_learnable_im_end), so decoding-window slots past a
    # reply's end learn to predict the end; 0 or 1 appends nothing; AR SFT and pretraining: unused
    num_learnable_end_tokens: int = 8
    # SFT: the share of blocks (0..1) in which a masked reply end masks the rest of the block, as a
    # decoding window often knows nothing past an undecided end (docs/method.md §2.1); 0 = uniform
    # masking, the method's; 1 = every block, which never shows an observed end copy after a masked end
    mask_after_masked_end: float = 0.0
    # leave the prediction-stream blocks without a masked slot out of each row (an SFT prompt's
    # blocks): nothing attends them and they carry no loss, so loss and gradients are unchanged and
    # SFT rows hold more pairs (docs/method.md §2.3); off = both streams whole, as the reference
    prune_unmasked_blocks: bool = False


@dataclass
class ParallelismConfig:
    """Model parallel layout; the data-parallel size is world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: every row split over cp ranks (mask-balanced), keys/values gathered
    virtual_pp: Optional[int] = None  # model chunks per pipeline stage (interleaved schedule); needs pp > 1
    dp: Optional[int] = None  # derived; if set, it must equal the derived value
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    recompute_num_layers: int = 1  # layers per recompute chunk when recompute=full
    ep: int = 1  # expert parallel (MoE): each layer's experts split over ep ranks of the dp x cp ranks
    etp: Optional[int] = None  # tensor parallel inside each expert (MoE); default: tp


@dataclass
class OptimizerConfig:
    """Adam(W) through Megatron's (distributed) optimizer, and the learning-rate schedule.

    Schedule (Megatron's ``OptimizerParamScheduler``): linear warmup from 0 to ``lr`` over
    ``warmup_steps``, then ``decay_style`` down to ``min_lr`` at ``decay_steps`` (default:
    ``trainer.train_steps``), constant ``min_lr`` after."""

    name: str = "adam"  # adam | sgd
    lr: float = 3e-6
    min_lr: float = 3e-7
    warmup_steps: int = 0
    decay_style: str = "cosine"  # cosine | linear | constant | inverse-square-root
    decay_steps: Optional[int] = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    use_distributed_optimizer: bool = True


@dataclass
class BlendSourceConfig:
    """One source of ``data.blend``: a directory written by ``tools/prepare_data.py`` (or a Megatron
    indexed dataset's prefix) and its share."""

    path: Optional[str] = None  # required
    weight: float = 1.0  # > 0; normalised over the blend (a share of the rows)
    name: Optional[str] = None  # in logs (tokens/<name>) and the data state; default: the path's basename


@dataclass
class DataConfig:
    """Tokenized webdataset shards from ``tools/prepare_data.py`` and how rows are formed.

    ``seq_length`` is the row length the model sees: a WeDLM row holds ``seq_length // 2``
    tokens (memory + prediction streams), an AR row ``seq_length`` tokens. ``num_streams`` fixes
    how shards are dealt out independently of the parallel layout, so a checkpoint resumes at
    the exact sample under another DP size or worker count; it must be a multiple of
    ``dp * num_workers`` and at most the number of shards."""

    # directory holding manifest.json, or the PREFIX of a Megatron indexed dataset (PREFIX.bin +
    # PREFIX.idx, pretraining only; docs/training.md "Megatron indexed datasets"); this or blend is required
    path: Optional[str] = None
    # several sources mixed by weight, [{path, weight, name}] (docs/training.md "Data blends"), or
    # Megatron-LM's --data-path form "0.3 /data/web 0.7 /data/code" (or a list of paths: equal
    # weights), turned into that list when the config is loaded; instead of path
    blend: Optional[List[BlendSourceConfig]] = None
    # a prepared directory (or prefix) of held-out documents (e.g. prepare_data.py --valid-fraction
    # writes <output>/valid): same task, tokenizer and mask id as the training data; None = no validation;
    # "auto" = <data.path>/valid when that was prepared, else none (resolved as the config is loaded)
    valid_path: Optional[str] = None
    # the HF tokenizer directory the Megatron indexed datasets among the sources were tokenized with,
    # which a prefix does not record; required when a source is a prefix (unused otherwise). It must
    # hold the mask token, because checkpoints and exports copy its files: the tokenizer/ of a
    # prepared directory and the output of convert_checkpoint.py hf-to-megatron do
    tokenizer: Optional[str] = None
    # documents of a prefix per virtual shard: prepare_data.py's default --samples-per-shard, so the
    # same documents give the same shards, hence the same rows, as prepared or as a prefix
    indexed_documents_per_shard: int = 10000
    # every document of a prefix must end with the tokenizer's EOS (preprocess_data.py --append-eod),
    # as prepared pretraining data does; true: the loader appends EOS to each document that lacks it
    append_eod: bool = False
    seq_length: int = 512
    micro_batch_size: int = 1
    global_batch_size: int = 8
    num_workers: int = 1
    num_streams: int = 8
    shuffle: bool = True
    seed: int = 1234
    prefetch_factor: int = 4


@dataclass
class CheckpointingConfig:
    """torch_dist checkpoints under ``dir`` (default ``<trainer.output_dir>/checkpoints``)."""

    dir: Optional[str] = None
    save_interval: int = 1000  # steps between saves; 0 = only at the end
    save_at_end: bool = True
    keep_last: int = 3  # complete checkpoints kept; 0 = keep all
    resume: str = "none"  # none | auto (latest complete checkpoint in dir, if any) | <path>
    load_optimizer: bool = True  # false: fresh optimizer moments (weights, schedule, data resume)
    load_data_state: bool = True  # false: restart the data streams from the beginning
    # true: resume the saved stream positions although the shard set's fingerprint (names, sizes,
    # sample and token counts) changed; only when every shard still holds the same samples
    allow_data_change: bool = False


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "megatron-wedlm"
    entity: Optional[str] = None
    name: Optional[str] = None  # default: the output directory's name
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    mode: str = "online"  # online | offline
    dir: Optional[str] = None  # default: <trainer.output_dir>


@dataclass
class LoggingConfig:
    log_interval: int = 1  # steps between metrics.jsonl / wandb records
    progress_bar: bool = True
    # per-device peak TFLOP/s that MFU is measured against; default: the bf16 dense peak of a
    # known GPU (training/throughput.py), none on CPU or fp32 (MFU then not reported)
    peak_tflops: Optional[float] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainerConfig:
    task: str = "pretrain"  # pretrain | sft (set by the entry point)
    backend: str = "megatron"  # megatron | deepspeed (SFT of HF checkpoints, megatron_wedlm.deepspeed_backend)
    output_dir: str = "outputs/run"
    # a fresh run (no --resume) into an output_dir holding checkpoints: refused when false; when
    # true the earlier run is moved aside to <output_dir>.replaced-<run id> (nothing is deleted)
    overwrite: bool = False
    train_steps: int = 1000
    exit_at_step: Optional[int] = None  # stop (and save) here, keeping the schedule of train_steps
    # on this signal (SLURM sends SIGTERM at a time limit, on scancel and on preemption) every rank
    # finishes its step, the run saves that step and exits 0; null: the signal's default (die at once)
    exit_signal: Optional[str] = "SIGTERM"
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 (CPU too: docs/training.md)
    max_consecutive_nonfinite: int = 3  # stop after this many skipped steps in a row
    eval_interval: int = 1000  # steps between validations (data.valid_path); also after the run's last step
    eval_iters: int = 10  # global batches per validation (Megatron's --eval-iters): the same rows every time
    distributed_timeout_s: float = 1800.0


@dataclass
class DeepSpeedConfig:
    """ZeRO settings of ``trainer.backend=deepspeed`` (HF checkpoints, no conversion).

    ``model.init_from`` is then a HF model directory (Qwen2 / Qwen3 / Llama / official WeDLM);
    ``parallelism.recompute`` != none turns on per-layer activation checkpointing. What holds
    only when that backend runs is checked by :mod:`megatron_wedlm.deepspeed_backend.settings`."""

    zero_stage: int = 2  # 1 | 2 | 3
    offload_optimizer: str = "none"  # none | cpu: optimizer states and step on the CPU (DeepSpeedCPUAdam)
    offload_params: str = "none"  # none | cpu: ZeRO-3 only, parameters live on the CPU between uses
    zero3_init: bool = True  # ZeRO-3: build/load the model already partitioned (needs `accelerate`)
    export_hf: bool = True  # also write a HF export (iter_N/hf) at every checkpoint save
    extra_config: Optional[str] = None  # JSON file merged last into the generated DeepSpeed config


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    wedlm: WeDLMConfig = field(default_factory=WeDLMConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # read by trainer.backend=deepspeed only


#: Allowed values of string-valued keys with a fixed set of choices.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.architecture": ("qwen2", "qwen3", "llama", "qwen3_moe"),
    "model.moe_load_balancing": LOAD_BALANCING_TYPES,
    "model.attention_backend": ATTENTION_BACKEND_NAMES,
    "wedlm.ratio_mode": ("block", "document"),
    "wedlm.loss_weighting": ("inverse_ratio", "uniform"),
    "parallelism.recompute": RECOMPUTE_MODES,
    "optimizer.name": ("adam", "sgd"),
    "optimizer.decay_style": ("cosine", "linear", "constant", "inverse-square-root"),
    "logging.wandb.mode": ("online", "offline"),
    "trainer.task": ("pretrain", "sft"),
    "trainer.backend": ("megatron", "deepspeed"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.precision": ("auto", "fp32", "bf16"),
    "trainer.exit_signal": ("SIGTERM", "SIGUSR1", "SIGUSR2"),
    "deepspeed.offload_optimizer": ("none", "cpu"),
    "deepspeed.offload_params": ("none", "cpu"),
}


def _get(cfg: TrainConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


#: Keys that must be > 0 and keys that must be >= 0 when set (None: not set, nothing to check).
_POSITIVE = (
    "wedlm.block_size", "parallelism.tp", "parallelism.pp", "parallelism.cp", "parallelism.dp",
    "parallelism.recompute_num_layers", "data.seq_length", "data.micro_batch_size",
    "data.global_batch_size", "data.num_streams", "data.prefetch_factor",
    "trainer.train_steps", "trainer.max_consecutive_nonfinite", "logging.log_interval", "logging.peak_tflops",
    "trainer.eval_interval", "trainer.eval_iters", "data.indexed_documents_per_shard",
    "model.make_vocab_size_divisible_by", "optimizer.lr", "trainer.exit_at_step",
    "model.num_layers", "model.hidden_size", "model.ffn_hidden_size",
    "model.num_attention_heads", "model.num_query_groups", "model.head_dim",
    "model.vocab_size", "model.max_position_embeddings", "parallelism.ep", "parallelism.etp",
    "model.num_experts", "model.moe_ffn_hidden_size", "model.moe_topk", "model.moe_capacity_factor",
)
_NON_NEGATIVE = (
    "data.num_workers", "checkpointing.save_interval", "checkpointing.keep_last",
    "optimizer.min_lr", "optimizer.warmup_steps", "optimizer.weight_decay",
    "optimizer.clip_grad", "wedlm.ar_weight", "data.seed", "trainer.seed",
    "wedlm.num_learnable_end_tokens", "model.moe_aux_loss_coeff", "model.moe_z_loss_coeff",
)


def validate_config(cfg: TrainConfig) -> None:
    """Check the rules a type cannot express; raise :class:`ConfigError` naming the key."""
    _check_choices_and_signs(cfg)
    _check_heads(cfg.model)
    _check_deepspeed(cfg.deepspeed)
    if not 0.0 < cfg.wedlm.mask_eps <= 1.0:
        raise ConfigError(f"wedlm.mask_eps={cfg.wedlm.mask_eps} must be in (0, 1]")
    if not 0.0 <= cfg.wedlm.mask_after_masked_end <= 1.0:
        raise ConfigError(f"wedlm.mask_after_masked_end={cfg.wedlm.mask_after_masked_end} is a share of blocks, in [0, 1]")
    _check_schedule(cfg)
    _check_sequence_parallel(cfg)
    _check_moe(cfg)
    _validate_context_and_virtual_pipeline(cfg)
    _check_attention_device(cfg)
    _check_data(cfg)
    if cfg.trainer.exit_at_step is not None and cfg.trainer.exit_at_step > cfg.trainer.train_steps:
        raise ConfigError(
            f"trainer.exit_at_step={cfg.trainer.exit_at_step} is past trainer.train_steps={cfg.trainer.train_steps}"
        )
    if not cfg.checkpointing.resume:
        raise ConfigError("checkpointing.resume must be 'none', 'auto' or a checkpoint path")
    _check_model_from_scratch(cfg.model)


def _check_choices_and_signs(cfg: TrainConfig) -> None:
    """Every key of :data:`CHOICES` holds one of its values; the keys of _POSITIVE and _NON_NEGATIVE their sign."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value is not None and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for keys, allow_zero in ((_POSITIVE, False), (_NON_NEGATIVE, True)):
        for key in keys:
            value = _get(cfg, key)
            if value is not None and (value < 0 or (value == 0 and not allow_zero)):
                raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def _check_deepspeed(ds: DeepSpeedConfig) -> None:
    if ds.zero_stage not in (1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage={ds.zero_stage} must be 1, 2 or 3")
    if ds.offload_params != "none" and ds.zero_stage != 3:
        raise ConfigError(
            f"deepspeed.offload_params={ds.offload_params!r} needs deepspeed.zero_stage=3 "
            f"(got {ds.zero_stage}): only ZeRO-3 partitions the parameters"
        )


def _check_schedule(cfg: TrainConfig) -> None:
    """The learning-rate schedule: a floor below the peak, warmup inside the decay horizon."""
    if cfg.optimizer.min_lr > cfg.optimizer.lr:
        raise ConfigError(f"optimizer.min_lr={cfg.optimizer.min_lr} is larger than optimizer.lr={cfg.optimizer.lr}")
    decay_steps = cfg.optimizer.decay_steps or cfg.trainer.train_steps
    if cfg.optimizer.warmup_steps >= decay_steps:
        raise ConfigError(
            f"optimizer.warmup_steps={cfg.optimizer.warmup_steps} must be smaller than the decay "
            f"horizon ({decay_steps} = optimizer.decay_steps or trainer.train_steps)"
        )


def _check_moe(cfg: TrainConfig) -> None:
    """MoE keys only on a MoE model; Megatron trains MoE under TP with sequence parallelism only."""
    m, par = cfg.model, cfg.parallelism
    moe_model = m.architecture == "qwen3_moe" or m.num_experts is not None
    if (par.ep > 1 or par.etp is not None) and m.architecture is not None and not moe_model:
        raise ConfigError(
            f"parallelism.ep={par.ep} / etp={par.etp} split experts, and model.architecture={m.architecture} has none; "
            "remove them or use a MoE model (qwen3_moe)"
        )
    if moe_model and cfg.trainer.backend != "megatron":
        raise ConfigError(f"MoE models train with trainer.backend=megatron, not {cfg.trainer.backend}")
    if moe_model and par.tp > 1 and not par.sequence_parallel:
        raise ConfigError(
            f"a MoE model with parallelism.tp={par.tp} needs parallelism.sequence_parallel=true (Megatron-Core "
            "routes each TP rank's share of the tokens; without SP every rank would route them all)"
        )
    if m.num_experts is not None and m.num_experts % par.ep:
        raise ConfigError(f"parallelism.ep={par.ep} must divide model.num_experts={m.num_experts}")


def _check_sequence_parallel(cfg: TrainConfig) -> None:
    if cfg.parallelism.sequence_parallel and cfg.parallelism.tp == 1:
        raise ConfigError("parallelism.sequence_parallel=true needs parallelism.tp > 1")
    if cfg.parallelism.sequence_parallel and cfg.data.seq_length % cfg.parallelism.tp:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} must be a multiple of parallelism.tp={cfg.parallelism.tp} "
            "with sequence parallelism (rows are split along the sequence)"
        )


def _check_attention_device(cfg: TrainConfig) -> None:
    backend = ATTENTION_BACKENDS.get(cfg.model.attention_backend)
    if backend is not None and backend.needs_cuda and cfg.trainer.device == "cpu":
        raise ConfigError(
            f"model.attention_backend={backend.name} needs a CUDA device, not trainer.device=cpu; use "
            f"{', '.join(backend_names(lambda b: not b.needs_cuda))}"
        )


def _check_data(cfg: TrainConfig) -> None:
    """A data directory, rows that hold a block in both streams, whole micro-batches per batch."""
    _check_data_sources(cfg.data)
    if cfg.wedlm.enabled and cfg.data.seq_length < 2 * cfg.wedlm.block_size:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} cannot hold one block of wedlm.block_size="
            f"{cfg.wedlm.block_size} tokens in both streams; use seq_length >= {2 * cfg.wedlm.block_size}"
        )
    if cfg.data.global_batch_size % cfg.data.micro_batch_size:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not a multiple of "
            f"data.micro_batch_size={cfg.data.micro_batch_size}"
        )


def blend_from_data_path(value: str | Sequence[Any]) -> list[dict[str, Any]]:
    """``data.blend`` in Megatron-LM's ``--data-path`` form as the ``[{path, weight}]`` list the
    schema holds: ``"0.3 /data/web 0.7 /data/code"`` (weights and paths alternating; a list of the
    same items too), or paths alone, which get equal weights (as Megatron-LM reads them). Weights
    are checked with the rest of the blend (:func:`_check_data_sources`)."""
    items = value.split() if isinstance(value, str) else [str(item) for item in value]
    if not items:
        raise ConfigError("data.blend is empty; give \"W1 PATH1 W2 PATH2 ...\" or [{path: P, weight: W}, ...], "
                          "or set data.path instead")
    numbers = [_number(item) for item in items]
    if len(items) % 2 == 0 and all(w is not None for w in numbers[0::2]):
        return [{"path": path, "weight": weight} for weight, path in zip(numbers[0::2], items[1::2])]
    if all(n is None for n in numbers):
        return [{"path": path, "weight": 1.0} for path in items]
    raise ConfigError(
        f"data.blend={value!r} is neither weights and paths alternating (\"0.3 /data/web 0.7 /data/code\") "
        "nor paths alone (equal weights)"
    )


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def indexed_options(data: DataConfig) -> dict[str, Any]:
    """How a Megatron indexed dataset among the sources is read (the keyword arguments of
    :func:`megatron_wedlm.data.indexed.read_source_manifest`)."""
    return {"tokenizer": data.tokenizer, "documents_per_shard": data.indexed_documents_per_shard,
            "append_eod": data.append_eod}


def _check_data_sources(data: DataConfig) -> None:
    """Exactly one of ``data.path`` and ``data.blend``; a blend's weights > 0 and its paths distinct."""
    if data.path is not None and data.blend is not None:
        raise ConfigError("data.path and data.blend are both set; set data.path for one source or data.blend to mix several")
    if data.blend is None:
        if data.path is None:
            raise ConfigError("data.path is required: the directory written by tools/prepare_data.py or the prefix "
                              "of a Megatron indexed dataset (or data.blend)")
        return
    if not data.blend:
        raise ConfigError("data.blend is empty; list [{path: DIR, weight: W}, ...] or set data.path instead")
    seen: dict[str, int] = {}
    for i, source in enumerate(data.blend):
        if not source.path:
            raise ConfigError(f"data.blend[{i}].path is required: a directory written by tools/prepare_data.py "
                              "or the prefix of a Megatron indexed dataset")
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise ConfigError(f"data.blend[{i}].weight={source.weight} must be > 0 (weights are normalised to sum to 1)")
        key = os.path.normpath(os.path.abspath(source.path))
        if key in seen:
            raise ConfigError(
                f"data.blend[{i}].path={source.path} repeats data.blend[{seen[key]}]; list each directory once "
                "and give it the sum of the weights"
            )
        seen[key] = i


def training_data_dir(cfg: TrainConfig) -> str | None:
    """The source (directory or indexed prefix) whose manifest and tokenizer describe the run's
    data: ``data.path``, or the first ``data.blend`` source (the others must match it)."""
    return cfg.data.path if cfg.data.blend is None else cfg.data.blend[0].path


def _check_model_from_scratch(model: ModelConfig) -> None:
    """Without ``model.init_from`` the architecture must be given in full."""
    if model.init_from is not None:
        return
    missing = [
        f"model.{k}"
        for k in ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        if getattr(model, k) is None
    ]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} must be set to build a model from scratch "
            "(or set model.init_from to a converted checkpoint)"
        )


def _check_heads(model: ModelConfig) -> None:
    """Head counts that split the model evenly, refused here rather than deep in RoPE or attention."""
    heads, hidden, groups = model.num_attention_heads, model.hidden_size, model.num_query_groups
    if heads is not None and hidden is not None and model.head_dim is None and hidden % heads:
        raise ConfigError(
            f"model.num_attention_heads={heads} does not divide model.hidden_size={hidden}; choose a head "
            "count that divides it (or set model.head_dim)"
        )
    if heads is not None and groups is not None and heads % groups:
        raise ConfigError(
            f"model.num_query_groups={groups} does not divide model.num_attention_heads={heads}; every "
            "key/value group must serve the same number of query heads"
        )


def _validate_context_and_virtual_pipeline(cfg: TrainConfig) -> None:
    """``parallelism.cp`` and ``parallelism.virtual_pp``: the combinations that cannot run."""
    par, seq = cfg.parallelism, cfg.data.seq_length
    if par.cp > 1:
        if cfg.trainer.backend != "megatron":
            raise ConfigError(
                f"parallelism.cp={par.cp} needs trainer.backend=megatron (the {cfg.trainer.backend} backend "
                "has no context parallelism); set parallelism.cp=1"
            )
        backend = ATTENTION_BACKENDS.get(cfg.model.attention_backend)
        if backend is not None and not backend.context_parallel:
            raise ConfigError(
                f"parallelism.cp={par.cp} does not work with model.attention_backend={backend.name} (its kernels "
                "take no dual-stream mask under context parallelism); use "
                f"{', '.join(backend_names(lambda b: b.context_parallel))}"
            )
        if seq % (2 * par.cp):
            raise ConfigError(
                f"data.seq_length={seq} must be a multiple of 2 x parallelism.cp = {2 * par.cp}: rows are cut "
                "into equal chunks that the context-parallel ranks share"
            )
        if par.sequence_parallel and seq % (par.cp * par.tp):
            raise ConfigError(
                f"data.seq_length={seq} must be a multiple of parallelism.cp x parallelism.tp = {par.cp * par.tp} "
                "with sequence parallelism (each context-parallel part is split again over tp)"
            )
    if par.virtual_pp is not None:
        if par.virtual_pp < 2 or par.pp < 2:
            raise ConfigError(
                f"parallelism.virtual_pp={par.virtual_pp} needs parallelism.pp > 1 (got {par.pp}) and at least 2 "
                "chunks per stage; remove parallelism.virtual_pp for a plain pipeline"
            )
        if cfg.trainer.backend != "megatron":
            raise ConfigError("parallelism.virtual_pp needs trainer.backend=megatron")
        layers = cfg.model.num_layers
        if layers is not None and layers % (par.pp * par.virtual_pp):
            raise ConfigError(
                f"model.num_layers={layers} must be a multiple of parallelism.pp x parallelism.virtual_pp = "
                f"{par.pp} x {par.virtual_pp} (every model chunk gets the same number of layers)"
            )


def validate_layout(cfg: TrainConfig, world_size: int) -> int:
    """The data-parallel size for ``world_size`` processes; ConfigError if the layout cannot work."""
    par = cfg.parallelism
    model_parallel = par.tp * par.pp * par.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallelism.tp x parallelism.pp x parallelism.cp = "
            f"{cfg.parallelism.tp} x {cfg.parallelism.pp} x {cfg.parallelism.cp}; launch a multiple of "
            f"{model_parallel} processes"
        )
    dp = world_size // model_parallel
    if cfg.parallelism.dp is not None and cfg.parallelism.dp != dp:
        raise ConfigError(
            f"parallelism.dp={cfg.parallelism.dp} but {world_size} processes with tp={cfg.parallelism.tp}, "
            f"pp={cfg.parallelism.pp}, cp={cfg.parallelism.cp} give dp={dp}; remove parallelism.dp or change the launch"
        )
    expert_ranks = par.ep * (par.etp or par.tp)
    if (world_size // par.pp) % expert_ranks:
        raise ConfigError(
            f"parallelism.ep x etp = {par.ep} x {par.etp or par.tp} does not divide the {world_size // par.pp} ranks "
            f"of each pipeline stage ({world_size} processes / pp {par.pp}); lower parallelism.ep or launch a "
            f"multiple of {expert_ranks * par.pp} processes"
        )
    rows_per_step = cfg.data.micro_batch_size * dp
    if cfg.data.global_batch_size % rows_per_step:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not a multiple of "
            f"data.micro_batch_size x dp = {cfg.data.micro_batch_size} x {dp}"
        )
    streams_per_round = dp * max(cfg.data.num_workers, 1)
    if cfg.data.num_streams % streams_per_round:
        raise ConfigError(
            f"data.num_streams={cfg.data.num_streams} is not a multiple of dp x data.num_workers = "
            f"{dp} x {max(cfg.data.num_workers, 1)}; every worker must own the same number of streams"
        )
    return dp
