"""``logprobs`` and ``echo`` of ``/v1/completions``, laid out as vLLM returns them.

What the numbers are and how lm-eval uses them: docs/serving.md. The forward
(:func:`~megatron_wedlm.decoding.log_likelihood.causal_log_likelihoods`) runs on the engine thread
between two decoding steps (:meth:`ServingEngine.run_between_steps`), because that thread keeps
packed attention on for its whole loop and a lock around its step would starve a scorer. A failing
scoring forward fails its own request only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from megatron_wedlm.decoding.log_likelihood import causal_log_likelihoods

from .engine import ServingEngine
from .openai_api import CompletionRequest

#: OpenAI's finite stand-in for a log-probability of minus infinity (vLLM clamps to it too)
LOGPROB_FLOOR = -9999.0
#: padded tokens of one scoring forward at most (its logits are ``tokens x vocab``); a longer sequence goes alone
BATCH_TOKENS = 4096


@dataclass(frozen=True)
class TokenScores:
    """Log-probabilities of ``ids[first:]``: ``logprobs[k]`` of ``ids[first + k]`` (None for the
    sequence's first token), ``top[k]`` the most likely ``(token id, logprob)`` pairs there.
    """

    ids: list[int]
    first: int
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]


def score_tokens(model, sequences: Sequence[Sequence[int]], first: Sequence[int], top_n: int,
                 batch_tokens: int = BATCH_TOKENS) -> list[TokenScores]:
    """:class:`TokenScores` of each ``sequences[i][first[i]:]`` with the ``top_n`` most likely
    tokens, up to ``batch_tokens`` padded tokens a forward.
    """
    scored = [i for i, seq in enumerate(sequences) if max(first[i], 1) < len(seq)]
    found = dict(zip(scored, causal_log_likelihoods(model, [sequences[i] for i in scored],
                                                    [max(first[i], 1) for i in scored], top_n=top_n,
                                                    batch_tokens=batch_tokens)))
    results = []
    for i, seq in enumerate(sequences):
        head: list[float | None] = [None] if first[i] == 0 else []
        one = found.get(i)
        results.append(TokenScores(list(seq), first[i], head + (one.logprobs if one else []),
                                   [[] for _ in head] + (one.top if one else [])))
    return results


def logprobs_object(tokenizer, scores: TokenScores, top_n: int) -> dict:
    """OpenAI's legacy completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``) of ``scores.ids[scores.first:]``, as vLLM lays it out."""
    ids = scores.ids[scores.first:]
    wanted = set(ids) | {t for row in scores.top for t, _ in row[:top_n]}
    order = sorted(wanted)
    text = dict(zip(order, tokenizer.batch_decode([[t] for t in order])))
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token, logprob, top in zip(ids, scores.logprobs, scores.top):
        tokens.append(text[token])
        offsets.append(offset)
        offset += len(text[token])
        if logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(max(logprob, LOGPROB_FLOOR))
        entries = {text[token]: max(logprob, LOGPROB_FLOOR)}  # the token first, then the top ones
        for other, value in top[:top_n]:
            entries.setdefault(text[other], max(value, LOGPROB_FLOOR))
        top_logprobs.append(entries)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


class CompletionScoring:
    """What ``echo`` and ``logprobs`` add to the choices of one completions request.

    Choice ``i`` answers prompt ``i`` (``texts[i]`` as sent, ``prompts[i]`` its ids); ``poll``: how
    often a wait checks whether the engine failed (seconds).
    """

    def __init__(self, engine: ServingEngine, tokenizer, texts: Sequence[str | list[int]],
                 prompts: Sequence[list[int]], echo: bool, top_n: int | None, poll: float = 0.5):
        self.engine, self.tokenizer, self.prompts = engine, tokenizer, list(prompts)
        self.echo, self.top_n, self.poll = echo, top_n, poll
        self.texts = [t if isinstance(t, str) else tokenizer.decode(t) for t in texts] if echo else []

    @classmethod
    def of(cls, body: CompletionRequest, engine: ServingEngine, tokenizer, texts: Sequence[str | list[int]],
           prompts: Sequence[list[int]], poll: float = 0.5) -> CompletionScoring | None:
        """The request's scoring, None when it asks for neither ``echo`` nor ``logprobs``."""
        if not body.echo and body.logprobs_top_n is None:
            return None
        return cls(engine, tokenizer, texts, prompts, body.echo, body.logprobs_top_n, poll)

    def prefix(self, index: int) -> str:
        return self.texts[index] if self.echo else ""

    async def logprobs(self, replies: Sequence[tuple[int, Sequence[int]]]) -> list[dict | None]:
        """The ``logprobs`` object of each ``(choice index, reply ids)``, scored in one engine job;
        raises the engine's failure if it stops meanwhile.
        """
        if self.top_n is None or not replies:
            return [None] * len(replies)
        sequences = [self.prompts[i] + list(reply) for i, reply in replies]
        first = [0 if self.echo else len(self.prompts[i]) for i, _ in replies]
        model, top_n = self.engine.model, self.top_n
        future = self.engine.run_between_steps(lambda: score_tokens(model, sequences, first, top_n))
        scores = await self._wait(future)
        return [logprobs_object(self.tokenizer, s, top_n) for s in scores]

    async def _wait(self, future: Future):
        waiting = asyncio.wrap_future(future)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self.poll)
                if done:
                    return waiting.result()
                failure = self.engine.failure  # an engine that died never runs the job
                if failure is not None:
                    raise failure
        finally:
            future.cancel()  # the request ended first (its client left, the engine failed): skip the job
