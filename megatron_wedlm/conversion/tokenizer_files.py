"""Tokenizer files that travel with a checkpoint, and the mask token WeDLM trains with.

An existing mask token (tokenizer or config) is kept and the files copied byte for byte;
otherwise ``<|mask|>`` is added and the caller gives it an embedding row (:mod:`.hf_to_megatron`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_wedlm.runtime.hf_local import (
    TOKENIZER_FILES,
    load_tokenizer,
    reference_mask_token_id,
    tokenizer_files_in,
)

from .hf_checkpoint import ConversionError

DEFAULT_MASK_TOKEN = "<|mask|>"


@dataclass(frozen=True)
class MaskTokenSetup:
    mask_token_id: int
    added: bool  # the token was added to the tokenizer by this conversion
    tokenizer_len: int  # tokens in the tokenizer before the addition


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[Path]:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in tokenizer_files_in(src):
        if file.resolve() != (dst / file.name).resolve():
            shutil.copyfile(file, dst / file.name)
        copied.append(dst / file.name)
    return copied


def prepare_tokenizer(
    src: str | Path,
    dst: str | Path,
    *,
    config: dict,
    mask_token: str = DEFAULT_MASK_TOKEN,
    add_mask_token: bool = True,
) -> MaskTokenSetup:
    """Put ``src``'s tokenizer into ``dst`` with a mask token, and return its id.

    The id: ``config``'s ``mask_token_id``, else the tokenizer's mask token, else (an official
    ``wedlm`` config) the reference engine's id if the tokenizer has it; only then is one added.
    """
    config_mask_token_id = config.get("mask_token_id")
    if not tokenizer_files_in(src):
        if config_mask_token_id is not None:
            return MaskTokenSetup(config_mask_token_id, added=False, tokenizer_len=-1)
        raise ConversionError(
            f"{src} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...) and its config.json has "
            "no mask_token_id, so the mask token cannot be found or added; put the tokenizer next to the weights"
        )
    tokenizer = load_tokenizer(src)
    length = len(tokenizer)
    own_id = tokenizer.mask_token_id if tokenizer.mask_token is not None else None
    if own_id is not None:
        if config_mask_token_id is not None and config_mask_token_id != own_id:
            raise ConversionError(
                f"config.json says mask_token_id={config_mask_token_id} but the tokenizer's mask token "
                f"{tokenizer.mask_token!r} has id {own_id}; fix one of them"
            )
        copy_tokenizer_files(src, dst)
        return MaskTokenSetup(own_id, added=False, tokenizer_len=length)
    if config_mask_token_id is None:
        config_mask_token_id = reference_mask_token_id(config, tokenizer)
    if config_mask_token_id is not None:
        copy_tokenizer_files(src, dst)
        return MaskTokenSetup(config_mask_token_id, added=False, tokenizer_len=length)
    existing = tokenizer.convert_tokens_to_ids(mask_token)
    if existing is not None and existing != tokenizer.unk_token_id:
        # The string is already a token, just not registered as the mask token: register it.
        tokenizer.add_special_tokens({"mask_token": mask_token})
        tokenizer.save_pretrained(str(dst))
        return MaskTokenSetup(int(existing), added=False, tokenizer_len=length)
    if not add_mask_token:
        raise ConversionError(
            f"the tokenizer in {src} has no mask token and {mask_token!r} is not in its vocabulary; "
            "allow adding one (drop --no-add-mask-token) or name an existing token with --mask-token"
        )
    tokenizer.add_special_tokens({"mask_token": mask_token})
    tokenizer.save_pretrained(str(dst))
    return MaskTokenSetup(int(tokenizer.mask_token_id), added=True, tokenizer_len=length)
