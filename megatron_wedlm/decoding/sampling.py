"""Per-slot token choice for parallel decoding: which mask slots to fill, and with what.

Entropies and tokens are computed for all mask slots of a batch at once (``[slots, vocab]``,
the slots of every row concatenated, no padding), so a decoding step costs a handful of tensor
ops, never a Python loop over the vocabulary.

Two distributions are involved, on purpose:

* the *confidence* of a slot is the entropy of the model's own distribution there
  (``softmax(logits)``, temperature 1, no top-k/top-p, mask token excluded). It measures how sure
  the model is, independently of the sampler knobs; using the sampling distribution instead
  would make greedy decoding (a one-hot distribution, entropy 0) fill every slot at once.
  This is also what the reference WeDLM engine does.
* the *token* put into a filled slot comes from the sampling distribution: argmax when
  ``temperature == 0``, else softmax(logits / T) restricted by top-k then top-p.

The mask token's logit is pushed to the lowest float before either is computed (by the model
runner), so a mask can never be emitted as output. The lowest finite value is used rather than
``-inf``: its probability is exactly 0 all the same, and entropy needs no NaN guard.

Selecting slots works on one row's Python floats: a row has at most 2W candidates, and its rule
("below tau, else the argmin") is clearer, and on a CPU faster, as a list operation than as a
padded batch of masked tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from .settings import DecodeSettings


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last dim (logits must be finite)."""
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
    """Which of one row's mask slots to fill this step: indices into ``slots``.

    ``slots`` are the row's remaining mask slots (window indices, ascending), ``slot_entropy``
    their entropies. The WeDLM rule: ``H~ = H + distance_penalty * d`` with ``d`` = window index
    minus that of the leftmost remaining mask. Every slot with ``H~ < entropy_threshold``
    (strict) is filled; if none qualifies (or ``entropy_threshold is None``: one slot per step)
    the single slot with the smallest ``H~`` is (the leftmost on ties), or with
    ``leftmost_fallback`` the leftmost slot: the reference rule's choice may lie past the first
    mask, and then the next forward commits nothing. The penalty favours
    slots near the committed prefix, which is what lets the leftmost filled run, and so the
    cacheable prefix, grow.

    ``stop_probability`` (the ``stop_penalty`` setting; None: the engine's rule above) is each
    slot's probability of a stop token. Going left to right, every slot that stays a mask this
    step adds ``-log(1 - p_stop)`` to the ``H~`` of the slots after it: a token there is only part
    of the reply if the reply has not ended before it, and a model that never saw text past an end
    in training predicts it as confidently as any other (docs/method.md §3.5). A slot filled this
    step adds nothing: its token is decided.
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
    """The token ids that end a reply on their own: ``stop_token_ids``, and every token whose text
    contains one of ``stop_strings`` (for a newline stop string, every token holding a newline).
    A stop string that only ever spans several tokens has no such token; ``stop_penalty`` then
    cannot see it."""
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
    """Step d of Algorithm 1 for a batch: entropies and tokens of all mask slots, then each row's fill rule."""

    def __init__(self, settings: DecodeSettings, generator: torch.Generator | None = None,
                 stop_vocabulary: Sequence[int] = ()):
        """``stop_vocabulary``: the ids whose probability ``settings.stop_penalty`` weighs
        (:func:`stop_token_vocabulary`); unused without it."""
        self.settings, self.generator = settings, generator
        self.stop_vocabulary = (torch.tensor(sorted(stop_vocabulary), dtype=torch.long)
                                if settings.stop_penalty and stop_vocabulary else None)

    def choose(self, logits: torch.Tensor, mask_slots: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """Per row ``(slots, tokens)`` to fill, given the logits ``[slots, vocab]`` of all rows' mask
        slots (rows concatenated in order) and each row's mask slots (window indices).

        Tokens are drawn only at the slots the fill rule chose (a few of a row's up to 2W), so the
        argmax or draw, a pass over the vocabulary, is not paid for slots that stay masks.
        """
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
        """Each slot's probability of a stop token (``softmax(logits)`` summed over the stop vocabulary)."""
        if self.stop_vocabulary is None:
            return None
        scores = logits.float()
        stops = self.stop_vocabulary.to(scores.device)
        stops = stops[stops < scores.shape[-1]]
        return (torch.logsumexp(scores[:, stops], -1) - torch.logsumexp(scores, -1)).exp().tolist()

    def _draw(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """One token from each of ``logits``'s ``rows`` (greedy or sampled)."""
        at = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        return sample_tokens(at, self.settings.temperature, self.settings.top_k, self.settings.top_p,
                             self.generator).tolist()

    def _hold_early_stops(self, logits: torch.Tensor, mask_slots: list[list[int]], starts: list[int],
                          fills: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
        """``contiguous_stop``: each row's fills less its early stop tokens; a row left with none fills
        its leftmost mask instead (one more draw, from that slot's logits: row ``starts[r]``)."""
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
    """The fills ``(slots, tokens)`` of one row without the stop tokens that would sit after a mask
    this step leaves unfilled (``masks``: the row's mask slots, ascending).

    Why (docs/method.md §3.5): a stop token ends the reply, so putting one into the window fixes the
    reply's length; the slots before it are then filled to fit that length. The model's prediction of
    an end several slots ahead is a guess about a length it has not written yet, often one slot off,
    and a reply whose end was placed one slot late gets a token too many (a copied string whose last
    letter comes twice). Held back, the stop token is put in once the slots before it are filled.
    """
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
    """One token per position of ``logits[..., vocab]``: argmax if ``temperature == 0``, else a draw.

    Sampling order (as in HF transformers): temperature, then top-k (0 = off), then top-p (1.0 = off,
    the most likely token is always kept). Draws use ``generator``, so a seeded generator makes the
    whole decode reproducible.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
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
