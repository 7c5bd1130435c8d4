"""What every decoding method returns, and the stop-string rule they share.

Metric definitions (docs/method.md §3.7), identical for all methods so they can be
compared side by side:

* ``token_ids``: the generated tokens only (prompt excluded), a ``list[int]``. A stop token is
  included; with a stop string, the tokens up to and including the one that completes it.
* ``num_forwards``: model calls made for this sequence. The prompt is prefilled in the *same*
  call as the first window (streaming/block-wise) or as the first AR step, so this is also the
  number of decode forwards: AR needs exactly one per generated token.
* ``num_slots`` (N_fwd): generated-token slots fed through those forwards (window slots for the
  parallel decoders, one per forward for AR); prompt tokens are not counted.
* ``p_cache = N_gen / N_fwd`` and ``tokens_per_forward = N_gen / num_forwards`` with
  ``N_gen = len(token_ids)``.
* ``seconds``: wall clock of the whole call, prefill included. For a batch, every row reports
  the wall clock of the whole batch (rows are decoded together, not one after another).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STOP_TOKEN = "stop_token"
STOP_STRING = "stop_string"
MAX_NEW_TOKENS = "max_new_tokens"
MAX_POSITIONS = "max_positions"


@dataclass
class GenerationResult:
    """Output and cost of one generated sequence; see the module docstring for each metric."""

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
        """The comparable numbers as a plain dict (for JSON reports)."""
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
    """The stop string that occurs first in the decoded ``token_ids``, or None.

    Returns ``(num_tokens, stop_string)`` where ``num_tokens`` is the length of the shortest token
    prefix whose text contains that stop string: generation keeps the token that completed it
    (tokens and text need not align, a stop string may end inside a token) and drops the rest.
    Among stop strings starting at the same character, the shortest wins.

    ``checked``: how many leading tokens are known to hold no stop string (a decoder's earlier
    call), so only a tail is decoded: a new hit ends after them and spans at most ``4 x len``
    tokens (a token is at least one byte, a character at most four), plus one for a character
    split at the tail's start. Each step then costs the new tokens, not the whole reply.
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
    """User-facing text of generated tokens: special tokens (e.g. EOS) dropped, cut before ``stop_string``."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    if stop_string:
        cut = text.find(stop_string)
        if cut >= 0:
            text = text[:cut]
    return text
