"""Decoding WeDLM checkpoints: streaming parallel decoding, the block-wise and AR baselines, loading.

All methods take a HF causal LM (``load_wedlm_model``) and token ids, and return a
:class:`GenerationResult` with the same metrics (see ``result.py`` for their definitions)::

    from megatron_wedlm.decoding import DecodeSettings, generate
    settings = DecodeSettings(window_size=16, entropy_threshold=0.4, distance_penalty=0.02,
                              max_new_tokens=256)  # stops at the model's EOS; stop_token_ids=() never stops
    r = generate(model, prompt_ids, settings)          # or generate(model, prompt_ids, window_size=16, ...)
    r.token_ids, r.num_forwards, r.num_slots, r.p_cache, r.tokens_per_forward, r.seconds

``settings.method`` (or ``method=`` as a keyword) switches between ``"streaming"``,
``"blockwise"`` and ``"ar"``; ``generate_batch`` decodes several prompts together.
"""

from .api import generate, generate_batch
from .checks import resolve_mask_token_id
from .loading import load_tokenizer, load_wedlm_model, wedlm_config_to_hf
from .result import GenerationResult
from .settings import METHODS, DecodeSettings

__all__ = [
    "METHODS",
    "DecodeSettings",
    "GenerationResult",
    "generate",
    "generate_batch",
    "load_tokenizer",
    "load_wedlm_model",
    "resolve_mask_token_id",
    "wedlm_config_to_hf",
]
