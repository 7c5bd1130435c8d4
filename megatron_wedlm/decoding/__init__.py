"""Decoding WeDLM checkpoints: streaming parallel decoding, the block-wise and AR baselines, loading.

All methods take a HF causal LM (``load_wedlm_model``) and token ids, and return a
:class:`GenerationResult` with the same metrics (see ``result.py`` for their definitions)::

    from megatron_wedlm.decoding import streaming_generate
    r = streaming_generate(model, prompt_ids, window_size=16, entropy_threshold=0.4,
                           distance_penalty=0.02, max_new_tokens=256, stop_token_ids=[eos])
    r.token_ids, r.num_forwards, r.num_slots, r.p_cache, r.tokens_per_forward, r.seconds

``generate(model, ids, method=...)`` / ``generate_batch(model, prompts, method=...)`` switch
between ``"streaming"``, ``"blockwise"`` and ``"ar"``.
"""

from .api import METHODS, generate, generate_batch
from .autoregressive import ar_generate, ar_generate_batch
from .checks import resolve_mask_token_id
from .loading import load_tokenizer, load_wedlm_model, wedlm_config_to_hf
from .parallel import blockwise_generate, parallel_generate_batch, streaming_generate
from .result import GenerationResult

__all__ = [
    "METHODS",
    "GenerationResult",
    "ar_generate",
    "ar_generate_batch",
    "blockwise_generate",
    "generate",
    "generate_batch",
    "load_tokenizer",
    "load_wedlm_model",
    "parallel_generate_batch",
    "resolve_mask_token_id",
    "streaming_generate",
    "wedlm_config_to_hf",
]
