"""HF model configs <-> the Megatron-Core model that holds the same weights.

:class:`ModelArgs` is the one description of a Qwen2 / Qwen3 / Llama model on the Megatron side:
read from a HF ``config.json``, saved beside a converted checkpoint as ``wedlm_model.json``,
and turned back into a HF config on export. It states what the HF config lacks (padded
vocabulary, mask token) and keeps the original config verbatim (:attr:`ModelArgs.hf_config`)
so unmodelled fields survive a round trip. Families differ only in q/k/v bias (Qwen2; Qwen3
with ``attention_bias``, its o_proj bias zero) and per-head q/k RMSNorm (Qwen3).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from megatron_wedlm.runtime.hf_local import wedlm_config_to_hf

#: File written next to a converted Megatron checkpoint.
MODEL_ARGS_FILE = "wedlm_model.json"

#: Megatron-LM's default: each tensor-parallel shard of the vocabulary is a multiple of this.
DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128

#: model_type -> transformers causal-LM class name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The HF config describes a model this project cannot convert or build."""


@dataclass
class ModelArgs:
    """Architecture of a Qwen2 / Qwen3 / Llama model as the Megatron side needs it."""

    architecture: str  # a key of SUPPORTED_ARCHITECTURES
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # rows of the HF embedding (and of the exported checkpoint)
    padded_vocab_size: int  # rows of the Megatron embedding the checkpoint was written with
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    qk_layernorm: bool
    add_qkv_bias: bool
    tie_word_embeddings: bool
    mask_token_id: int | None = None
    dtype: str = "bfloat16"  # dtype of the weights as stored
    make_vocab_size_divisible_by: int = DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY
    hf_config: dict[str, Any] = field(default_factory=dict)  # original config.json, for export
    # Mixture of experts (qwen3_moe): every layer's MLP is num_experts SwiGLU experts of
    # moe_ffn_hidden_size, top-moe_topk routed; the top-k weights renormalised if moe_norm_topk_prob.
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_topk: int | None = None
    moe_norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_message(self.architecture))
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups} (num_key_value_heads)"
            )
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary (vocab_size={self.vocab_size})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        given = sum(f is not None for f in (self.num_experts, self.moe_ffn_hidden_size, self.moe_topk))
        if given not in (0, 3) or (given == 3) != (self.architecture == "qwen3_moe"):
            raise ValueError(
                f"architecture {self.architecture!r} with num_experts={self.num_experts}, moe_ffn_hidden_size="
                f"{self.moe_ffn_hidden_size}, moe_topk={self.moe_topk}: qwen3_moe needs all three, dense models none"
            )
        if self.is_moe and not 0 < self.moe_topk <= self.num_experts:
            raise ValueError(f"moe_topk={self.moe_topk} must be in 1..num_experts={self.num_experts}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def qkv_rows(self) -> int:
        """Output rows of Megatron's fused ``linear_qkv``: all query heads plus K and V per group."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelArgs fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def _unsupported_message(architecture: str, classes: list[str] | None = None) -> str:
    supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    named = f" ({', '.join(classes)})" if classes else ""
    return f"unsupported architecture {architecture!r}{named}; supported architectures: {supported}"


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int = 1) -> int:
    """Round up so every TP shard of the vocabulary is a multiple of ``divisor`` (padded for TP=1
    with 128, it splits evenly for any power-of-two TP up to 128).
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


# --------------------------------------------------------------------------------------------
# HF config -> ModelArgs
# --------------------------------------------------------------------------------------------


def _as_config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    return config.to_dict()


def _normalised_hf_config(raw: dict[str, Any]):
    """A transformers config for ``raw``, legacy fields (``rope_theta``) normalised."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    if model_type == "wedlm":
        # Official WeDLM checkpoints: same weights as the AR family they came from.
        _, config = wedlm_config_to_hf(raw)
        if raw.get("mask_token_id") is not None:
            config.mask_token_id = raw["mask_token_id"]
        return config
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(_unsupported_message(str(model_type), raw.get("architectures")))
    fields_ = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return AutoConfig.for_model(model_type, **fields_)
    except (KeyError, TypeError, ValueError) as err:
        raise UnsupportedModelError(f"transformers rejects this {model_type} config: {err}") from err


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"rope type {rope_type!r} (rope_parameters={params}) is not supported; only the default "
            "RoPE (a rope_theta, no scaling) is converted"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the config gives no rope_theta")
    return float(theta)


def _check_supported_features(config: Any) -> None:
    arch = config.model_type
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={config.hidden_act!r} is not supported; only 'silu' (SwiGLU)")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError("use_sliding_window=true is not supported (WeDLM needs full causal attention)")
    if arch == "llama" and getattr(config, "attention_bias", False):
        raise UnsupportedModelError(
            "llama with attention_bias=true (biases on q/k/v *and* o_proj) is not supported; "
            "Megatron's add_qkv_bias covers q/k/v only"
        )
    if arch == "llama" and getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("llama with mlp_bias=true is not supported")
    if arch == "qwen3_moe" and (config.mlp_only_layers or config.decoder_sparse_step != 1):
        raise UnsupportedModelError(
            f"qwen3_moe with dense layers (mlp_only_layers={config.mlp_only_layers}, decoder_sparse_step="
            f"{config.decoder_sparse_step}) is not supported; every layer must be a MoE layer "
            "(mlp_only_layers=[], decoder_sparse_step=1, as in Qwen3-30B-A3B and Qwen3-235B-A22B)"
        )


def _check_heads(raw: dict[str, Any], config: Any) -> None:
    """Refuse head counts that do not split the model evenly (here, not deep in RoPE)."""
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    groups = int(getattr(config, "num_key_value_heads", None) or heads)
    if raw.get("head_dim") is None and hidden % heads:
        raise UnsupportedModelError(
            f"num_attention_heads={heads} does not divide hidden_size={hidden} and the config gives no "
            "head_dim; fix num_attention_heads (or state head_dim) in config.json"
        )
    if heads % groups:
        raise UnsupportedModelError(
            f"num_key_value_heads={groups} does not divide num_attention_heads={heads}; every key/value "
            "head must serve the same number of query heads: fix config.json"
        )


def _has_qkv_bias(config: Any) -> bool:
    """Qwen2 always; Qwen3 with ``attention_bias`` (its o_proj bias must then be zero or absent)."""
    return config.model_type == "qwen2" or (config.model_type in _QWEN3 and bool(config.attention_bias))


_QWEN3 = ("qwen3", "qwen3_moe")  # q/k RMSNorm, optional attention_bias


def model_args_from_hf_config(
    config: Any,
    *,
    make_vocab_size_divisible_by: int = DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY,
    tensor_model_parallel_size: int = 1,
    vocab_size: int | None = None,
    mask_token_id: int | None = None,
) -> ModelArgs:
    """:class:`ModelArgs` of a HF config; ``vocab_size`` overrides the config's (grown for a mask
    token), ``mask_token_id`` defaults to the config's.
    """
    raw = _as_config_dict(config)
    hf = _normalised_hf_config(raw)
    _check_supported_features(hf)
    _check_heads(raw, hf)
    rows = int(vocab_size if vocab_size is not None else hf.vocab_size)
    heads = int(hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if mask_token_id is None:
        mask_token_id = raw.get("mask_token_id")
    return ModelArgs(
        architecture=hf.model_type,
        num_layers=int(hf.num_hidden_layers),
        hidden_size=int(hf.hidden_size),
        ffn_hidden_size=int(hf.intermediate_size),
        num_attention_heads=heads,
        num_query_groups=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        vocab_size=rows,
        padded_vocab_size=pad_vocab_size(rows, make_vocab_size_divisible_by, tensor_model_parallel_size),
        max_position_embeddings=int(hf.max_position_embeddings),
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.rms_norm_eps),
        qk_layernorm=hf.model_type in _QWEN3,
        add_qkv_bias=_has_qkv_bias(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        mask_token_id=mask_token_id,
        dtype=dtype,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hf_config={k: v for k, v in raw.items() if k != "transformers_version"},
        **_moe_fields(hf),
    )


def _moe_fields(config: Any) -> dict[str, Any]:
    if config.model_type != "qwen3_moe":
        return {}
    return dict(num_experts=int(config.num_experts), moe_ffn_hidden_size=int(config.moe_intermediate_size),
                moe_topk=int(config.num_experts_per_tok), moe_norm_topk_prob=bool(config.norm_topk_prob))


# --------------------------------------------------------------------------------------------
# ModelArgs -> HF config
# --------------------------------------------------------------------------------------------


def hf_config_from_model_args(args: ModelArgs):
    """The exported checkpoint's transformers config: the original one (unmodelled fields kept)
    with everything :class:`ModelArgs` states, and ``mask_token_id``.
    """
    from transformers import AutoConfig

    base = {
        k: v
        for k, v in args.hf_config.items()
        if k not in ("model_type", "architectures", "auto_map", "transformers_version", "torch_dtype",
                     "rope_theta", "rope_scaling", "qk_norm")
    }
    base.update(
        num_hidden_layers=args.num_layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_word_embeddings,
        hidden_act="silu",
        dtype=args.dtype,
    )
    if args.architecture == "qwen2":
        base.pop("attention_bias", None)
    else:
        base["attention_bias"] = args.add_qkv_bias  # qwen3 only (see _has_qkv_bias)
    if args.architecture == "llama":
        base["mlp_bias"] = False
    if args.is_moe:
        base.pop("num_local_experts", None)
        base.update(num_experts=args.num_experts, moe_intermediate_size=args.moe_ffn_hidden_size,
                    num_experts_per_tok=args.moe_topk, norm_topk_prob=args.moe_norm_topk_prob,
                    mlp_only_layers=[], decoder_sparse_step=1)
    if "layer_types" in base and len(base["layer_types"]) != args.num_layers:
        base.pop("layer_types")
    config = AutoConfig.for_model(args.architecture, **base)
    config.architectures = [SUPPORTED_ARCHITECTURES[args.architecture]]
    if args.mask_token_id is not None:
        config.mask_token_id = args.mask_token_id
    return config


# --------------------------------------------------------------------------------------------
# wedlm_model.json
# --------------------------------------------------------------------------------------------


def save_model_args(args: ModelArgs, directory: str | Path) -> Path:
    path = Path(directory) / MODEL_ARGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(args.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def find_model_args_file(directory: str | Path) -> Path | None:
    """``wedlm_model.json`` in ``directory`` or one of its two parents, or None."""
    directory = Path(directory).resolve()
    for candidate in (directory, *list(directory.parents)[:2]):
        if (candidate / MODEL_ARGS_FILE).is_file():
            return candidate / MODEL_ARGS_FILE
    return None


def load_model_args(path: str | Path) -> ModelArgs:
    """Read ``wedlm_model.json`` (``path``: the file or a directory searched as above)."""
    path = Path(path)
    file = path if path.is_file() else find_model_args_file(path)
    if file is None:
        raise FileNotFoundError(
            f"no {MODEL_ARGS_FILE} in {path} or its parents; it is written by "
            "`tools/convert_checkpoint.py hf-to-megatron` (or pass its path explicitly)"
        )
    return ModelArgs.from_dict(json.loads(file.read_text()))
