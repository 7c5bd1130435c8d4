"""Text deltas of a reply streamed as token commits arrive.

Each commit decodes the whole reply so far and sends the new settled part, holding back a
trailing U+FFFD (a split character) and any tail that may begin a stop string, so the deltas
always add up to the non-streamed reply.
"""

from __future__ import annotations

from collections.abc import Sequence


def settled_length(text: str, stop_strings: Sequence[str]) -> int:
    """How much of ``text`` may be sent: up to a stop string, without a tail that may begin one."""
    end = len(text)
    for stop in stop_strings:
        found = text.find(stop)
        if found >= 0:
            end = min(end, found)
        for k in range(min(len(stop) - 1, len(text)), 0, -1):  # the longest tail that starts the stop string
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    while end and text[end - 1] == "\ufffd":  # part of a character whose other bytes are still to come
        end -= 1
    return end


class TextStream:
    """One reply's sent text; :meth:`delta` returns what a commit adds."""

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        self.tokens: list[int] = []
        self.sent = ""

    def delta(self, tokens: Sequence[int], final_text: str | None = None) -> str:
        """The text to send after ``tokens`` were committed; ``final_text``: the reply's text once it ended."""
        self.tokens += tokens
        if final_text is not None:
            text = final_text
        else:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            text = text[: settled_length(text, self.stop_strings)]
        if not text.startswith(self.sent):  # a later token changed how earlier ones decode: wait for the end
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
