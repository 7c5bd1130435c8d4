"""megatron-wedlm: WeDLM (causal-attention diffusion LMs) training and decoding on Megatron-Core.

The package is split by concern:

* ``megatron_wedlm.data``      dual-stream batches and the WeDLM attention-mask rule
* ``megatron_wedlm.model``     Megatron-Core layer specs, WeDLM GPT model, losses
* ``megatron_wedlm.decoding``  streaming parallel decoding, block-wise and AR baselines
* ``megatron_wedlm.runtime``   CPU compatibility layer, parallel-state helpers, multi-process launcher
* ``megatron_wedlm.testing``   equivalence workers and tiny models for tests and verification tools
"""

__version__ = "0.1.0"
