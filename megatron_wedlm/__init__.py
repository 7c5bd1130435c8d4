"""megatron-wedlm: WeDLM (causal-attention diffusion LMs) training and decoding on Megatron-Core.

The package is split by concern:

* ``megatron_wedlm.data``      dual-stream batches and the WeDLM attention-mask rule
* ``megatron_wedlm.model``     Megatron-Core layer specs, WeDLM GPT model, losses
* ``megatron_wedlm.decoding``  streaming parallel decoding, block-wise and AR baselines
* ``megatron_wedlm.runtime``   CPU compatibility layer and parallel-state helpers
* ``megatron_wedlm.testing``   multi-process harness used by tests and verification tools
"""

__version__ = "0.1.0"
