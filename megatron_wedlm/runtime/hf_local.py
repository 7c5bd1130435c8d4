"""Load HF checkpoint directories from local disk without ever running code that came with them.

Every ``from_pretrained`` of the project goes through :func:`load_pretrained`
(``trust_remote_code=False``, ``local_files_only=True``); the published WeDLM checkpoints load as
the AR family they came from (:func:`wedlm_config_to_hf`). Also the one rule for the mask token a
checkpoint names (:func:`checkpoint_mask_token_id`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The id the reference engine (Tencent/WeDLM ``wedlm/engine``) uses when neither the config nor
#: the tokenizer names a mask token: the first token Qwen2.5's tokenizer does not have.
REFERENCE_MASK_TOKEN_ID = 151665

#: ``model_type`` of the published WeDLM checkpoints.
WEDLM_MODEL_TYPE = "wedlm"


_NOT_CONFIG_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version")


def wedlm_config_to_hf(raw: dict[str, Any]):
    """Map an official ``model_type: "wedlm"`` config dict to ``(model_class, config)`` of the AR
    family it came from (Qwen3 with ``qk_norm``, else Qwen2 with bias, else Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in raw.items() if k not in _NOT_CONFIG_FIELDS}
    qk_norm = bool(fields.pop("qk_norm", False))
    bias = bool(fields.pop("attention_bias", True))
    if qk_norm:
        return Qwen3ForCausalLM, Qwen3Config(**fields, attention_bias=bias)
    if bias:
        return Qwen2ForCausalLM, Qwen2Config(**fields)
    return LlamaForCausalLM, LlamaConfig(**fields, attention_bias=False, mlp_bias=False)


def _local_dir(path: str | Path, what: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{what} directory {directory} does not exist; give a local directory (download a Hub model first, "
            "e.g. `hf download tencent/WeDLM-8B-Instruct --local-dir DIR`)"
        )
    return directory


def load_pretrained(cls: Any, path: str | Path, **kwargs: Any) -> Any:
    """``cls.from_pretrained(path, **kwargs)`` from a local directory, with remote code refused;
    a directory that only works with its ``auto_map`` files raises ``ValueError``."""
    directory = _local_dir(path, cls.__name__)
    try:
        return cls.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True, **kwargs)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(
            f"{directory}: {cls.__name__} would need the Python files named by `auto_map` in its config; this project "
            f"never runs checkpoint code. transformers said: {err}"
        ) from None


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a HF model directory as a dict (nothing in it is executed)."""
    config_file = _local_dir(path, "model") / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{Path(path)} is not a HF model directory (no config.json)")
    return json.loads(config_file.read_text())


def load_tokenizer(path: str | Path):
    """The HF tokenizer saved in ``path``, without remote code: for a ``model_type`` transformers
    does not know (``wedlm``) the class comes from ``tokenizer_config.json``, not ``auto_map``."""
    from transformers import AutoTokenizer, PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    directory = _local_dir(path, "tokenizer")
    config_file = directory / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    kwargs = {} if model_type is None or model_type in CONFIG_MAPPING else {"config": PreTrainedConfig()}
    return load_pretrained(AutoTokenizer, directory, **kwargs)


#: Files that make up a HF tokenizer (whichever of them exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_files_in(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def checkpoint_tokenizer(path: str | Path):
    """The tokenizer saved next to a checkpoint's weights, or None when there is none."""
    return load_tokenizer(path) if tokenizer_files_in(path) else None


def has_token_id(tokenizer, token_id: int) -> bool:
    """Whether ``token_id`` is a token of ``tokenizer`` (ids may be sparse: ``len`` is not enough)."""
    return token_id in tokenizer.added_tokens_decoder or tokenizer.convert_ids_to_tokens(int(token_id)) is not None


def reference_mask_token_id(config: dict[str, Any], tokenizer) -> int | None:
    """:data:`REFERENCE_MASK_TOKEN_ID` for a ``wedlm`` config naming no mask token, only when that id
    is an added token of the checkpoint's tokenizer (so no ordinary word becomes the mask); logged."""
    if config.get("model_type") != WEDLM_MODEL_TYPE or config.get("mask_token_id") is not None:
        return None
    if tokenizer is None or getattr(tokenizer, "mask_token", None) is not None:
        return None
    token = tokenizer.added_tokens_decoder.get(REFERENCE_MASK_TOKEN_ID)
    if token is None:
        return None
    logger.warning(
        "mask token: id %d (%r) -- the config has no mask_token_id and the tokenizer no mask token, so the "
        "reference engine's default id is used; the tokenizer has it as an added%s token",
        REFERENCE_MASK_TOKEN_ID, str(token), " special" if token.special else "",
    )
    return REFERENCE_MASK_TOKEN_ID


def checkpoint_mask_token_id(config: dict[str, Any], tokenizer) -> int | None:
    """The mask token a checkpoint names: ``config.json``'s ``mask_token_id``, else its tokenizer's
    mask token, else (``wedlm`` configs) :func:`reference_mask_token_id`; None when nothing names one."""
    if config.get("mask_token_id") is not None:
        return int(config["mask_token_id"])
    if tokenizer is not None and getattr(tokenizer, "mask_token", None) is not None:
        return int(tokenizer.mask_token_id)
    return reference_mask_token_id(config, tokenizer)
