"""Per-slot token choice for parallel decoding: which mask slots to fill, and with what.

Confidence is the entropy of the model's own distribution (temperature 1, no top-k/top-p: greedy
must not make every slot certain); tokens come from the sampler (docs/method.md §3.4). Logits
arrive with the mask token at the lowest finite value, so it is never drawn.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from .settings import DecodeSettings


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def select_slots(
    slot_entropy: Sequence[float],
    slots: Sequence[int],
    entropy_threshold: float | None,
    distance_penalty: float,
    stop_probability: Sequence[float] | None = None,
    leftmost_fallback: bool = False,
) -> list[int]:
    """Indices into ``slots`` (one row's masks) to fill by the rule of docs/method.md §3.4.

    ``stop_probability`` (``stop_penalty``; None: off) adds ``-log(1 - p_stop)`` of each slot left
    masked to the scores of the later slots (§3.5).
    """
    first = slots[0]
    chosen, adjusted, ended = [], [], 0.0  # ended: -log P(no stop in the masks left unfilled so far)
    for j, (h, s) in enumerate(zip(slot_entropy, slots)):
        adjusted.append(h + distance_penalty * (s - first) + ended)
        if entropy_threshold is not None and adjusted[j] < entropy_threshold:
            chosen.append(j)
        elif stop_probability is not None:
            ended -= math.log1p(-min(stop_probability[j], _MAX_STOP_PROBABILITY))
    if chosen:
        return chosen
    return [0] if leftmost_fallback else [min(range(len(adjusted)), key=adjusted.__getitem__)]


#: keeps ``-log(1 - p)`` finite (about 16 nats, which no threshold clears) where a stop is certain
_MAX_STOP_PROBABILITY = 1.0 - 1e-7


def stop_token_vocabulary(tokenizer, stop_token_ids: Sequence[int], stop_strings: Sequence[str]) -> list[int]:
    """``stop_token_ids`` and every token whose text contains a stop string."""
    ids = set(stop_token_ids)
    if stop_strings:
        ids |= _tokens_containing(tokenizer, tuple(stop_strings))
    return sorted(ids)


@functools.lru_cache(maxsize=8)
def _tokens_containing(tokenizer, stop_strings: tuple[str, ...]) -> frozenset[int]:
    # one pass over the vocabulary per tokenizer and stop strings, not one per decode call
    return frozenset(i for i in range(len(tokenizer))
                     if any(stop in tokenizer.decode([i]) for stop in stop_strings))


class SlotSampler:
    """Step d for a batch: entropies and tokens of all mask slots, then each row's fill rule."""

    def __init__(self, settings: DecodeSettings, generator: torch.Generator | None = None,
                 stop_vocabulary: Sequence[int] = ()):
        self.settings, self.generator = settings, generator
        self.stop_vocabulary = (torch.tensor(sorted(stop_vocabulary), dtype=torch.long)
                                if settings.stop_penalty and stop_vocabulary else None)

    def choose(self, logits: torch.Tensor, mask_slots: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """Per row ``(slots, tokens)`` to fill, from all rows' mask logits (rows concatenated)."""
        s = self.settings
        if not logits.shape[0]:
            return [([], []) for _ in mask_slots]
        if all(len(slots) == 1 for slots in mask_slots):  # one mask each (AR rows): the rule can only pick it
            tokens = self._draw(logits, list(range(len(mask_slots))))
            return [(slots, [token]) for slots, token in zip(mask_slots, tokens)]
        entropies = entropy(logits).tolist()
        stops = self._stop_probability(logits)
        chosen, picks, starts, k = [], [], [], 0  # per row: indices into its slots, its first row of ``logits``
        for slots in mask_slots:
            starts.append(k)
            row_entropy = entropies[k : k + len(slots)]
            row_stops = None if stops is None else stops[k : k + len(slots)]
            rule = (select_slots(row_entropy, slots, s.entropy_threshold, s.distance_penalty, row_stops,
                                 s.leftmost_fallback) if slots else [])
            chosen.append(rule)
            picks += [k + j for j in rule]
            k += len(slots)
        tokens = iter(self._draw(logits, picks))
        fills = [([slots[j] for j in rule], [next(tokens) for _ in rule]) for slots, rule in zip(mask_slots, chosen)]
        if s.contiguous_stop and s.stop_token_ids:
            fills = self._hold_early_stops(logits, mask_slots, starts, fills)
        return fills

    def _stop_probability(self, logits: torch.Tensor) -> list[float] | None:
        if self.stop_vocabulary is None:
            return None
        scores = logits.float()
        stops = self.stop_vocabulary.to(scores.device)
        stops = stops[stops < scores.shape[-1]]
        return (torch.logsumexp(scores[:, stops], -1) - torch.logsumexp(scores, -1)).exp().tolist()

    def _draw(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        at = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        return sample_tokens(at, self.settings.temperature, self.settings.top_k, self.settings.top_p,
                             self.generator).tolist()

    def _hold_early_stops(self, logits: torch.Tensor, mask_slots: list[list[int]], starts: list[int],
                          fills: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
        """``contiguous_stop``; a row left with no fill fills its leftmost mask."""
        stops = frozenset(self.settings.stop_token_ids)
        held = [hold_early_stops(slots, tokens, masks, stops) for (slots, tokens), masks in zip(fills, mask_slots)]
        empty = [r for r, (slots, _) in enumerate(held) if not slots and mask_slots[r]]
        if empty:
            for r, token in zip(empty, self._draw(logits, [starts[r] for r in empty])):
                held[r] = ([mask_slots[r][0]], [token])
        return held


def hold_early_stops(
    slots: Sequence[int], tokens: Sequence[int], masks: Sequence[int], stop_ids: frozenset[int]
) -> tuple[list[int], list[int]]:
    """One row's fills less the stop tokens after a mask left unfilled (§3.5)."""
    fill = dict(zip(slots, tokens))
    kept_slots, kept_tokens = [], []
    prefix_filled = True  # every mask left of the current one is filled this step
    for slot in masks:
        token = fill.get(slot)
        if token is None or (token in stop_ids and not prefix_filled):
            prefix_filled = False
            continue
        kept_slots.append(slot)
        kept_tokens.append(token)
    return kept_slots, kept_tokens


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Argmax at ``temperature == 0``, else a draw (temperature, top-k, top-p, as HF)."""
    if temperature == 0:  # argmax's first maximum; max's kernel is 4x faster on bf16 CPU logits
        return logits.max(dim=-1).indices
    scores = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
