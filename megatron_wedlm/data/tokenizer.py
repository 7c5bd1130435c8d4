"""A byte-level BPE tokenizer trained on a local corpus, saved as a HF tokenizer (quickstart, tiny test models).

Qwen2's pipeline, because the exported ``qwen2``/``qwen3`` checkpoint's tokenizer is reloaded as
``Qwen2Tokenizer``, and a BPE trained otherwise would encode differently after the export
(:func:`check_reload` proves the ids survive). Special tokens ``<|endoftext|>`` (EOS), ``<|pad|>``
and ``<|mask|>`` have the fixed ids 0, 1, 2.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from megatron_wedlm.runtime.hf_local import load_tokenizer

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)

#: Qwen2's pre-tokenization regex (what ``Qwen2Tokenizer`` applies on reload).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Iterable[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """The raw ``tokenizers`` BPE (Qwen2 normalizer, pre-tokenizer and decoder) learnt from ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def as_hf_tokenizer(tok: Tokenizer, mask_token: str | None = MASK_TOKEN) -> PreTrainedTokenizerFast:
    """Wrap a trained ``tokenizers`` object as a normal HF fast tokenizer with our special tokens."""
    extra = {"mask_token": mask_token} if mask_token is not None else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False, **extra
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``vocab_size`` entries (special tokens included) learnt from ``texts``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size}")
    return as_hf_tokenizer(train_byte_level_bpe(texts, vocab_size))


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Save as a standard HF tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def check_reload(
    tokenizer_dir: str | Path, texts: Sequence[str], model_type: str = "qwen2"
) -> PreTrainedTokenizerBase:
    """Reload ``tokenizer_dir`` as it will be after the export (alone, and beside a minimal
    ``config.json`` of ``model_type``, which picks transformers' model-specific class) and require
    identical ids; returns the tokenizer, or raises ValueError naming the first text that encodes
    differently or does not decode back to itself."""
    original = load_tokenizer(tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                (Path(tmp) / f.name).write_bytes(f.read_bytes())
        (Path(tmp) / "config.json").write_text(json.dumps({"model_type": model_type}))
        reloaded = load_tokenizer(tmp)
    for name, tok in (("reloaded", original), (f"reloaded next to a {model_type} config", reloaded)):
        if tok.mask_token_id != original.mask_token_id or tok.eos_token_id != original.eos_token_id:
            raise ValueError(f"{name} tokenizer changed the special-token ids (mask/eos)")
    for text in texts:
        ids = original(text, add_special_tokens=False)["input_ids"]
        again = reloaded(text, add_special_tokens=False)["input_ids"]
        if ids != again:
            raise ValueError(
                f"tokenizer in {tokenizer_dir} encodes {text[:60]!r} differently after a reload as "
                f"{type(reloaded).__name__}; it must use Qwen2's pre-tokenization (see this module)"
            )
        if original.decode(ids) != text:
            raise ValueError(f"tokenizer does not decode {text[:60]!r} back to itself")
    return original
