"""The one settings object of every decoding method (nano-vllm's ``SamplingParams``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

STREAMING = "streaming"
BLOCKWISE = "blockwise"
AUTOREGRESSIVE = "ar"
METHODS = (STREAMING, BLOCKWISE, AUTOREGRESSIVE)
PARALLEL_METHODS = (STREAMING, BLOCKWISE)
#: Settings that only the parallel decoders read (AR ignores them, so one object drives all methods).
PARALLEL_ONLY = ("window_size", "entropy_threshold", "distance_penalty", "fused_refill", "contiguous_stop",
                 "stop_penalty", "leftmost_fallback")


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


@dataclass(frozen=True)
class DecodeSettings:
    """Everything that steers a decode, validated once (docs/method.md §3.3-§3.5).

    ``entropy_threshold`` None: one slot per forward. ``stop_token_ids`` None: the model's EOS
    (:func:`~.checks.eos_token_ids`), ``()``: none; ``stop_strings`` need a tokenizer.
    """

    method: str = STREAMING
    window_size: int = 16
    entropy_threshold: float | None = 0.4
    distance_penalty: float = 0.02
    fused_refill: bool = True
    contiguous_stop: bool = False
    stop_penalty: bool = False
    leftmost_fallback: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = field(default=())
    mask_token_id: int | None = None

    def __post_init__(self):
        # lists and tensors are accepted for the sequences; stored as tuples so the object stays hashable
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings or ()))
        if self.method not in METHODS:
            raise ValueError(f"unknown decoding method {self.method!r}; choose one of {METHODS}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.entropy_threshold is not None and math.isnan(self.entropy_threshold):
            raise ValueError("entropy_threshold must be a number or None (one slot per forward), got nan")
        if self.distance_penalty < 0:
            raise ValueError(f"distance_penalty must be >= 0, got {self.distance_penalty}")
        if self.mask_token_id is not None and self.mask_token_id in (self.stop_token_ids or ()):
            raise ValueError(f"the mask token {self.mask_token_id} cannot be a stop token (stop_token_ids: "
                             f"{list(self.stop_token_ids)}, by default the model's EOS ids)")
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @classmethod
    def build(cls, settings: "DecodeSettings | None" = None, **overrides) -> "DecodeSettings":
        """``settings`` with ``overrides``; unknown keywords are named."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown decoding setting(s) {unknown}; known: {[f.name for f in dataclasses.fields(cls)]}")
        return dataclasses.replace(settings or cls(), **overrides)

    @property
    def is_parallel(self) -> bool:
        return self.method in PARALLEL_METHODS

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
