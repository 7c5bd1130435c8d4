"""Streaming against AR decoding of one model on real chat prompts: speed and agreement.

Each prompt is decoded greedily by both, one at a time, alternating which goes first so machine
noise hits both alike; a chat reply has no answer key, so agreement is with the AR reply. Under
torchrun each rank decodes every ``world``-th prompt and rank 0 sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megatron_wedlm.decoding.api import generate
from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids
from megatron_wedlm.decoding.settings import AUTOREGRESSIVE, STREAMING, DecodeSettings
from megatron_wedlm.eval.sharding import Shard

__all__ = ["ChatDecodes", "ChatSummary", "common_prefix", "decode_chat_prompts", "summarize_chat"]


@dataclass(frozen=True)
class ChatDecodes:
    """One prompt decoded by both methods (token ids without the stop token, forwards, seconds)."""

    index: int
    ar_ids: tuple[int, ...]
    ar_forwards: int
    ar_seconds: float
    streaming_ids: tuple[int, ...]
    streaming_forwards: int
    streaming_seconds: float


@dataclass(frozen=True)
class ChatSummary:
    prompts: int
    ar_tokens: int
    ar_forwards: int
    ar_seconds: float
    streaming_tokens: int
    streaming_forwards: int
    streaming_seconds: float
    identical: int  # replies where streaming's tokens equal AR's
    mean_common_prefix: float  # tokens, over prompts
    mean_ar_length: float

    @property
    def streaming_tokens_per_forward(self) -> float:
        return self.streaming_tokens / max(self.streaming_forwards, 1)

    @property
    def ar_tokens_per_second(self) -> float:
        return self.ar_tokens / self.ar_seconds if self.ar_seconds else 0.0

    @property
    def streaming_tokens_per_second(self) -> float:
        return self.streaming_tokens / self.streaming_seconds if self.streaming_seconds else 0.0

    @property
    def speedup(self) -> float:
        """Streaming's tokens/s over AR's, same model, same prompts."""
        return self.streaming_tokens_per_second / self.ar_tokens_per_second if self.ar_tokens_per_second else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"streaming_tokens_per_forward": self.streaming_tokens_per_forward,
                               "ar_tokens_per_second": self.ar_tokens_per_second,
                               "streaming_tokens_per_second": self.streaming_tokens_per_second,
                               "speedup": self.speedup}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def decode_chat_prompts(model: Any, tokenizer: Any, prompts: Sequence[str], settings: DecodeSettings,
                        shard: Shard | None = None, on_prompt=None, ar_only: bool = False) -> list[ChatDecodes] | None:
    """Both methods on each of this rank's prompts (chat template, greedy); every rank's decodes
    on rank 0 in prompt order, None on the others. ``settings`` gives the window, tau and budget
    (its method is ignored). One untimed decode of each method first warms the kernels.
    ``ar_only`` (an AR model, the base): AR alone, streaming's fields left empty."""
    shard = shard or Shard()
    settings = DecodeSettings.build(settings, stop_token_ids=eos_token_ids(model, tokenizer), temperature=0.0)
    mine = [i for i in range(len(prompts)) if shard.owns(i)]
    methods = (AUTOREGRESSIVE,) if ar_only else (AUTOREGRESSIVE, STREAMING)
    if mine:
        warm = encode_prompt(tokenizer, prompts[mine[0]], chat=True)
        for method in methods:
            generate(model, warm, settings, method=method, max_new_tokens=4, tokenizer=tokenizer)
    stops = set(settings.stop_token_ids)
    out = []
    for k, i in enumerate(mine):
        ids = encode_prompt(tokenizer, prompts[i], chat=True)
        order = methods if k % 2 == 0 else methods[::-1]
        runs = {m: generate(model, ids, settings, method=m, tokenizer=tokenizer) for m in order}
        ar, st = runs[AUTOREGRESSIVE], runs.get(STREAMING)
        out.append(ChatDecodes(i, tuple(t for t in ar.token_ids if t not in stops), ar.num_forwards, ar.seconds,
                               tuple(t for t in st.token_ids if t not in stops) if st else (),
                               st.num_forwards if st else 0, st.seconds if st else 0.0))
        if on_prompt is not None:
            on_prompt(len(out), len(mine))
    gathered = shard.gather([asdict(d) for d in out])
    if gathered is None:
        return None
    decodes = [ChatDecodes(**{**d, "ar_ids": tuple(d["ar_ids"]), "streaming_ids": tuple(d["streaming_ids"])})
               for d in gathered]
    return sorted(decodes, key=lambda d: d.index)


def summarize_chat(decodes: Sequence[ChatDecodes]) -> ChatSummary:
    """Totals over prompts; tokens count the reply without its stop token, as AR and streaming both end at it."""
    n = len(decodes)
    if not n:
        raise ValueError("no chat prompts were decoded")
    return ChatSummary(
        prompts=n,
        ar_tokens=sum(len(d.ar_ids) for d in decodes),
        ar_forwards=sum(d.ar_forwards for d in decodes),
        ar_seconds=sum(d.ar_seconds for d in decodes),
        streaming_tokens=sum(len(d.streaming_ids) for d in decodes),
        streaming_forwards=sum(d.streaming_forwards for d in decodes),
        streaming_seconds=sum(d.streaming_seconds for d in decodes),
        identical=sum(d.ar_ids == d.streaming_ids for d in decodes),
        mean_common_prefix=sum(common_prefix(d.ar_ids, d.streaming_ids) for d in decodes) / n,
        mean_ar_length=sum(len(d.ar_ids) for d in decodes) / n,
    )
