"""What every decoding method returns (metrics: docs/method.md §3.7), and the stop-string rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STOP_TOKEN = "stop_token"
STOP_STRING = "stop_string"
MAX_NEW_TOKENS = "max_new_tokens"
MAX_POSITIONS = "max_positions"


@dataclass
class GenerationResult:
    """Output and cost of one generated sequence."""

    token_ids: list[int]
    num_forwards: int
    num_slots: int
    seconds: float
    method: str
    stop_reason: str = MAX_NEW_TOKENS
    text: str | None = None
    stop_string: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)

    @property
    def p_cache(self) -> float:
        return self.num_generated / self.num_slots if self.num_slots else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.num_generated / self.num_forwards if self.num_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else 0.0

    def metrics(self) -> dict:
        return {
            "method": self.method,
            "num_generated": self.num_generated,
            "forwards": self.num_forwards,
            "slots": self.num_slots,
            "tokens_per_forward": self.tokens_per_forward,
            "p_cache": self.p_cache,
            "seconds": self.seconds,
            "tokens_per_sec": self.tokens_per_second,
            "stop_reason": self.stop_reason,
        }


def find_stop_string(tokenizer, token_ids: Sequence[int], stop_strings: Sequence[str],
                     checked: int = 0) -> tuple[int, str] | None:
    """``(num_tokens, stop_string)`` of the stop string first in ``token_ids``' text, or None.

    ``num_tokens``: the shortest prefix containing it (shortest string on ties); ``checked``:
    leading tokens known to hold none, so only a tail is decoded.
    """
    if not stop_strings or not token_ids:
        return None
    ids = list(token_ids)
    if checked > 0:
        start = max(0, checked - (4 * max(len(s) for s in stop_strings) + 2))
        tail = tokenizer.decode(ids[start:], skip_special_tokens=False)
        if not any(s and s in tail for s in stop_strings):
            return None
    text = tokenizer.decode(ids, skip_special_tokens=False)
    hits = [(text.find(s), len(s), s) for s in stop_strings if s and s in text]
    if not hits:
        return None
    stop = min(hits)[2]
    lo, hi = 1, len(ids)  # smallest prefix containing the stop string, by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tokenizer.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo, stop


def decode_text(tokenizer, token_ids: Sequence[int], stop_string: str | None = None) -> str:
    """User-facing text: special tokens dropped, cut before ``stop_string``."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    if stop_string:
        cut = text.find(stop_string)
        if cut >= 0:
            text = text[:cut]
    return text
