"""megatron-wedlm: WeDLM (causal-attention diffusion LMs) training and decoding on Megatron-Core.
Its packages and their layering: docs/architecture.md.
"""

__version__ = "0.1.0"
