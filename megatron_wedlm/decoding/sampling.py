"""Per-slot token choice for parallel decoding: which mask slots to fill, and with what.

All functions work on a whole batch of windows at once (``[rows, slots, vocab]``) so a decoding
step costs a handful of tensor ops, never a Python loop over slots.

Two distributions are involved, on purpose:

* the *confidence* of a slot is the entropy of the model's own distribution there
  (``softmax(logits)``, temperature 1, no top-k/top-p, mask token excluded). It measures how sure
  the model is, independently of the sampler knobs; using the sampling distribution instead
  would make greedy decoding (a one-hot distribution, entropy 0) fill every slot at once.
  This is also what the reference WeDLM engine does.
* the *token* put into a filled slot comes from the sampling distribution: argmax when
  ``temperature == 0``, else softmax(logits / T) restricted by top-k then top-p.

The mask token's logit is pushed to the lowest float before either is computed, so a mask can
never be emitted as output.
"""

from __future__ import annotations

import torch


def exclude_token(logits: torch.Tensor, token_id: int) -> torch.Tensor:
    """``logits`` with ``token_id`` made impossible, without modifying the input.

    The lowest finite value is used rather than ``-inf``: its probability is exactly 0 all the
    same, and entropy needs no NaN guard for ``0 * log 0``.
    """
    out = logits.clone()
    out[..., token_id] = torch.finfo(out.dtype).min
    return out


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last dim (logits must be finite)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def select_slots(
    slot_entropy: torch.Tensor,
    is_candidate: torch.Tensor,
    distance: torch.Tensor,
    entropy_threshold: float | None,
    distance_penalty: float,
) -> torch.Tensor:
    """Which candidate mask slots to fill this step (bool, same shape as ``slot_entropy``).

    The WeDLM rule: ``H~ = H + distance_penalty * distance``, where ``distance`` counts window
    slots from the row's leftmost remaining mask. Every candidate with ``H~ < entropy_threshold``
    is filled; a row where none qualifies (or ``entropy_threshold is None``: one slot per step)
    fills its single candidate with the smallest ``H~`` (the leftmost on ties). The penalty favours
    slots near the committed prefix, which is what lets the leftmost filled run, and so the
    cacheable prefix, grow. Rows without candidates fill nothing.
    """
    adjusted = slot_entropy + distance_penalty * distance.to(slot_entropy.dtype)
    adjusted = adjusted.masked_fill(~is_candidate, float("inf"))
    if entropy_threshold is None:
        fill = torch.zeros_like(is_candidate)
    else:
        fill = adjusted < entropy_threshold
    needs_one = ~fill.any(dim=1) & is_candidate.any(dim=1)
    best = torch.nn.functional.one_hot(adjusted.argmin(dim=1), is_candidate.shape[1]).bool()
    return fill | (best & needs_one[:, None])


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


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Reject sampler settings that have no meaning, naming the argument."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
